"""A parameter's gradient, and a model's parameters each once.

DDP gives every trainable parameter ``param.main_grad`` (a view into its gradient buffer);
without DDP the gradient is autograd's ``param.grad``. :func:`grad_of` reads whichever holds it.
The tags mg keeps on parameters are read in :mod:`mg_parallel.tags`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from mg_parallel.tags import main_grad

__all__ = ["grad_of", "unique_params"]


def grad_of(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient the optimizer uses: ``param.main_grad`` when DDP gave it one, else ``.grad``."""
    g = main_grad(param)
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
