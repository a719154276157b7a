"""A counting GEMM recipe and an independent count of torch's matmul calls, to check that every matmul of a
model goes through its recipe.

:class:`CountingGemm` is the plain recipe that counts its calls per method and knows when one is running.
:class:`MatmulAudit` is a ``TorchFunctionMode`` that sees every Python-level call of a matmul-family torch
function (``F.linear``, ``torch.mm``, ``matmul``, ``@``, ``addmm``, ``bmm``, ``_grouped_mm``, ...) wherever it is
made, custom autograd backwards included, and records those made while no recipe call is running, with the
line that made them. Attention's ``scaled_dot_product_attention`` is not in the family. Backward matmuls that
autograd derives from a recipe's own differentiable call (``F.linear``'s) run below the Python level: they
belong to that recipe call.
"""

from __future__ import annotations

import inspect
import sys
from collections import Counter

import torch
from torch.autograd.graph import _engine_run_backward
from torch.overrides import TorchFunctionMode

from mg_parallel.gemm import Gemm

MATMUL_FAMILY = frozenset({
    "linear", "mm", "matmul", "__matmul__", "__rmatmul__", "addmm", "addmm_", "bmm", "baddbmm", "addbmm",
    "_grouped_mm", "einsum", "mv", "addmv", "tensordot", "bilinear", "chain_matmul", "dot", "inner",
})


class CountingGemm(Gemm):
    """The plain recipe, counting its calls by method name (``calls``)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.running = 0

    def _count(self, kind: str, fn, *args, **kwargs) -> torch.Tensor:
        self.calls[kind] += 1
        self.running += 1
        try:
            return fn(*args, **kwargs)
        finally:
            self.running -= 1

    def linear(self, x, weight, bias=None):
        return self._count("linear", super().linear, x, weight, bias)

    def mm(self, a, b, *, out=None):
        return self._count("mm", super().mm, a, b, out=out)

    def grouped_mm(self, x, w, offs):
        return self._count("grouped_mm", super().grouped_mm, x, w, offs)


def _caller() -> str:
    """``function (dir/file:line)`` of the innermost frame outside torch and this file (where the matmul was
    written)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path != __file__ and "/torch/" not in path:
            return f"{frame.f_code.co_qualname} ({'/'.join(path.split('/')[-2:])}:{frame.f_lineno})"
        frame = frame.f_back
    return "?"


class MatmulAudit(TorchFunctionMode):
    """Counts matmul-family torch calls: ``inside`` a call of ``recipe``, and ``outside`` (their call sites)."""

    def __init__(self, recipe: CountingGemm) -> None:
        super().__init__()
        self.recipe = recipe
        self.inside: Counter[str] = Counter()
        self.outside: list[str] = []

    def _backward(self, func, args, kwargs) -> None:
        """Run a backward pass with the mode on: torch turns it off while its handler runs, and calling
        ``backward`` again would hand the call back here, so the autograd engine is called directly."""
        call = inspect.signature(func).bind(*args, **kwargs).arguments
        tensors = call.get("self", call.get("tensors"))
        grads = call.get("gradient", call.get("grad_tensors"))
        assert not call.get("create_graph") and call.get("inputs") is None, "only plain backward passes are audited"
        tensors = (tensors,) if torch.is_tensor(tensors) else tuple(tensors)
        grads = (grads,) if torch.is_tensor(grads) else tuple(grads or [None] * len(tensors))
        grads = tuple(torch.ones_like(t) if g is None else g for t, g in zip(tensors, grads))
        with self:
            _engine_run_backward(tensors, grads, bool(call.get("retain_graph")), False, (),
                                 allow_unreachable=True, accumulate_grad=True)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            return self._backward(func, args, kwargs or {})
        if name in MATMUL_FAMILY:
            if self.recipe.running:
                self.inside[name] += 1
            else:
                self.outside.append(f"{name} in {_caller()}")
        return func(*args, **(kwargs or {}))
