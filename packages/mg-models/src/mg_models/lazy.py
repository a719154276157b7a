"""Lazy package exports: a package names what it exports and the module holding each, and the module is imported
on first use (so a family's config and family object load without its model's layers, and ``import mg_models``
stays cheap)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``exports`` maps a name to the module holding it, relative to the
    package (``"model"``) or absolute (``"mg_models.heads"``)."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            module = exports[name]
            return getattr(importlib.import_module(module if "." in module else f"{package}.{module}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
