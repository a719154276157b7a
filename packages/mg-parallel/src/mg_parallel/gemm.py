"""One entry point for the matrix multiplies of mg's layers: the GEMM recipe.

Every weight matmul of the parallel layers goes through the recipe the layer holds (its ``gemm``
attribute): the column- and row-parallel linears (the backward matmuls of the fused column-parallel
autograd function too), the chunked vocabulary-parallel loss, the MoE router's gate and shared-expert
gate, and the experts (both the per-expert loop and ``torch._grouped_mm``). A recipe is an object with
three methods, one per kind of matmul those layers make:

==============  ===========================  =======================================================
method          computes                     used by
==============  ===========================  =======================================================
``linear``      ``x @ weight.T (+ bias)``    the linears' and gates' forward, the chunked loss's logits
``mm``          ``a @ b`` (2-D, ``out=``)    the custom autograd backwards, the experts' loop
``grouped_mm``  ``x[rows of g] @ w[g]``      the experts' grouped path (``offs`` ends each group)
==============  ===========================  =======================================================

:class:`Gemm` is the plain recipe: each method is exactly the torch call the layers made before it
existed, so results are bit-identical. Another arithmetic (fp8 with scaling factors, say) is one
subclass overriding these methods; a method that changes the forward also owns its backward (wrap it in
an autograd function), since ``linear`` and ``grouped_mm`` are differentiated by autograd.

Layers take ``gemm=`` at construction (default :data:`PLAIN_GEMM`, shared and stateless), and
:func:`use_gemm` sets a recipe on every module of a built model that holds one; there is no global
"current recipe". :class:`~mg_parallel.precision.Precision` carries the recipe of a policy
(``precision.gemm``), for a caller that builds a model and then applies it.

Not routed here: attention's score and value products (``scaled_dot_product_attention`` and the
context-parallel blocks, which multiply activations by activations), and the probe that checks once
whether ``torch._grouped_mm`` runs on a device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PLAIN_GEMM", "Gemm", "use_gemm"]


class Gemm:
    """The plain GEMM recipe: ``F.linear``, ``torch.mm`` and ``torch._grouped_mm`` as they are.

    Subclass it to change how the layers multiply (quantise the operands, scale, accumulate
    differently); keep each method's shapes and dtypes. Instances are shared between layers, so a
    recipe keeps no per-call state it does not synchronise itself.
    """

    __slots__ = ()

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T + bias``: ``x [*, in]``, ``weight [out, in]``, ``bias [out]`` or None -> ``[*, out]``.

        Differentiable (autograd computes its backward). Its backward must not read its output: the
        row-parallel linear sums the output over the tensor-parallel group in place.
        """
        return F.linear(x, weight, bias)

    def mm(self, a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """``a @ b`` for 2-D ``a [m, k]`` and ``b [k, n]`` -> ``[m, n]``, written into ``out`` when given.

        Called inside custom autograd functions' forward and backward (the weight and input gradients of
        the column-parallel linear, the experts' loop), so it need not be differentiable.
        """
        if out is None:
            return torch.mm(a, b)
        return torch.mm(a, b, out=out)

    def grouped_mm(self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Rows ``[offs[g-1], offs[g])`` of ``x [M, in]`` times ``w[g]`` of ``w [G, in, out]`` -> ``[M, out]``.

        ``offs`` is the int32 cumulative row count per group ``[G]``. Differentiable (autograd computes
        its backward; see :func:`mg_parallel.moe.grouped_mm_supported` for where it runs).
        """
        return torch._grouped_mm(x, w, offs=offs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


PLAIN_GEMM = Gemm()
"""The plain recipe every layer holds unless given another (stateless; shared)."""


def use_gemm(model: nn.Module, recipe: Gemm, *, where: Callable[[str, nn.Module], bool] | None = None) -> int:
    """Set ``recipe`` on every module of ``model`` that multiplies through a recipe; returns how many.

    Those modules are the ones whose ``gemm`` attribute holds a :class:`Gemm` (mg's parallel linears,
    routers, experts, MoE layers, and any module of your own that follows the same convention).

    Args:
        model: a built model (or any module tree).
        recipe: the recipe to use from now on.
        where: ``where(name, module)`` picks the modules to change (e.g. keep routers in the plain
            recipe); None: all of them.

    Raises:
        TypeError: ``recipe`` is not a :class:`Gemm`.
    """
    if not isinstance(recipe, Gemm):
        raise TypeError(f"use_gemm needs a mg_parallel.gemm.Gemm recipe, got {type(recipe).__name__}")
    count = 0
    for name, module in model.named_modules():
        if isinstance(module.__dict__.get("gemm"), Gemm) and (where is None or where(name, module)):
            module.gemm = recipe
            count += 1
    return count
