"""The attributes mg keeps on parameters, read in one place.

DDP gives every trainable parameter ``param.main_grad`` (a view into its gradient buffer);
without DDP the gradient is autograd's ``param.grad``. :func:`grad_of` reads whichever holds it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["grad_of", "unique_params"]


def grad_of(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient the optimizer uses: ``param.main_grad`` when DDP gave it one, else ``.grad``."""
    g = getattr(param, "main_grad", None)
    return g if g is not None else param.grad


def unique_params(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    """Every trainable parameter of ``modules``, each once (a tied one too), in registration order."""
    seen: set[int] = set()
    out = []
    for module in modules:
        for p in module.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out
