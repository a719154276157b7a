"""Every package module parsed once for the rule tests."""

from __future__ import annotations

import ast

import pytest

from tests.architecture import rules


@pytest.fixture(scope="session")
def sources() -> list[tuple[str, ast.Module]]:
    """(path relative to the repository, syntax tree) of every module under packages/*/src."""
    parsed = [rules.parse(p) for p in rules.source_files()]
    packages = {path.split("/")[1] for path, _ in parsed}
    assert packages == {"mg-parallel", "mg-models", "mg-data", "mg-ckpt", "mg-cli"}, packages
    return parsed
