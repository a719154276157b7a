"""The local experts of an MoE layer, computed together, and where each lives globally.

Weights are stored ``[E_local, in, out]`` (tokens multiply from the left, ``x @ w``), one tensor
per projection for all local experts:

* SwiGLU: ``w1 [E_local, h, 2, f/etp]`` (gate ``[..., 0, :]`` and up ``[..., 1, :]``) and
  ``w2 [E_local, f/etp, h]``: ``y = (silu(x w_gate) * (x w_up)) w2``;
* GELU: ``w1 [E_local, h, f/etp]``, ``w2 [E_local, f/etp, h]``: ``y = gelu(x w1) w2``.

Local expert ``i`` of ep rank ``r`` is global expert ``r * E_local + i``, so the global tensor of a
projection is ``[num_experts, ...]`` and this rank's block starts at ``r * E_local`` along dim 0
(and, with expert tensor parallelism, at ``tp_rank * f/etp`` along the ``f`` dimension).
:func:`expert_shard_info` returns that global shape and offset (what a checkpoint of global tensors
needs); every expert parameter carries the tags it reads (``expert_parallel``, ``num_experts``,
``ep_rank``, and the tensor-parallel tags of ``tensor_parallel.utils``).

**Paths.** ``grouped_mm`` runs all experts in one ``torch._grouped_mm`` per projection (chosen
on accelerators where this torch build runs it forward and backward for the weights' dtype, device
and sizes, checked once with a tiny probe); ``loop`` runs one matmul per expert, written into one
output and, in backward, straight into one weight-gradient tensor, and for SwiGLU runs each
expert's whole MLP before the next one's (:class:`_LoopedSwiGLU`). It is the CPU's choice: there
``_grouped_mm`` runs one group at a time, and the loop measured 1.1x faster at Mixtral's shape.
An expert that receives no token gets a zero gradient on either path. Every matmul of both paths, forward
and backward, is the layer's GEMM recipe's (``self.gemm``: ``grouped_mm``, or ``mm`` per expert; see
:mod:`mg_parallel.gemm`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mg_parallel.collectives import all_reduce_coalesced
from mg_parallel.gemm import PLAIN_GEMM, Gemm
from mg_parallel.params import grad_of, unique_params
from mg_parallel.tags import expert_layout, global_block, is_expert_parallel, set_expert_parallel
from mg_parallel.tensor_parallel.mappings import copy_to_tp_region, reduce_from_tp_region
from mg_parallel.tensor_parallel.utils import group_rank, group_size

__all__ = ["GroupedExperts", "allreduce_expert_grads", "expert_shard_info", "grouped_mm_supported", "is_expert_param"]

_PROBED: dict[tuple, bool] = {}


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous (``_grouped_mm`` rejects broadcast grads)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class _SwiGLU(torch.autograd.Function):
    """``silu(h[:, :f]) * h[:, f:]`` for ``h [M, 2f]``; backward writes both halves' gradients into one
    ``[M, 2f]`` tensor (no concatenation of two halves; saves ``h`` only)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h)
        gate, up = h.chunk(2, -1)
        return F.silu(gate).mul_(up)  # one new tensor, not two (a fresh large CPU tensor costs its page faults)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (h,) = ctx.saved_tensors
        grad_h = torch.empty_like(h)
        _swiglu_backward(h, grad, grad_h)
        return grad_h


def _swiglu_backward(h: torch.Tensor, grad: torch.Tensor, grad_h: torch.Tensor) -> None:
    """Write the gradient of ``silu(h[:, :f]) * h[:, f:]`` with respect to ``h`` into ``grad_h``."""
    gate, up = h.chunk(2, -1)
    grad_gate, grad_up = grad_h.chunk(2, -1)
    torch.mul(F.silu(gate), grad, out=grad_up)  # (silu writing into a strided view is slow on CPU)
    torch.mul(grad, up, out=grad_gate)  # then silu's backward in place there: no temporary
    torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)


class _LoopedMM(torch.autograd.Function):
    """``x_e @ w[e]`` for each expert's row block, written into one output (no cat); backward writes each
    expert's weight gradient straight into one ``[E, in, out]`` tensor (no stack, zeros for idle experts)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, splits: list[int], gemm: Gemm) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.splits, ctx.gemm = splits, gemm
        out = x.new_empty((x.shape[0], w.shape[-1]))
        for xe, we, oe in zip(x.split(splits), w.unbind(0), out.split(splits)):
            gemm.mm(xe, we, out=oe)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        x, w = ctx.saved_tensors
        gemm = ctx.gemm
        grad = grad.contiguous()
        grad_x, grad_w = torch.empty_like(x), torch.empty_like(w)
        for xe, we, ge, gxe, gwe in zip(x.split(ctx.splits), w.unbind(0), grad.split(ctx.splits),
                                        grad_x.split(ctx.splits), grad_w.unbind(0)):
            gemm.mm(ge, we.t(), out=gxe)
            gemm.mm(xe.t(), ge, out=gwe)  # an expert without rows: a zero gradient
        return grad_x, grad_w, None, None


class _LoopedSwiGLU(torch.autograd.Function):
    """A whole SwiGLU expert MLP per expert's row block: ``(silu(x_e g_e) * (x_e u_e)) w2_e``.

    Each expert's ``[m, 2f]`` pre-activation is made, activated and projected down before the next
    expert's, so the elementwise work reads tensors the matmul has just written (still in cache) and
    every temporary is one expert's size (on the CPU a fresh ``[M, 2f]`` tensor costs its page faults).
    Saves each expert's pre-activation and activation, as the separate products would; backward
    runs expert by expert the same way, writing the input gradient into one ``[M, h]`` tensor and the
    weight gradients straight into ``[E, h, 2f]`` and ``[E, f, h]`` (zeros for an idle expert).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, splits: list[int], gemm: Gemm
                ) -> torch.Tensor:
        out = x.new_empty((x.shape[0], w2.shape[-1]))
        saved = []
        for xe, w1e, w2e, oe in zip(x.split(splits), w1.unbind(0), w2.unbind(0), out.split(splits)):
            he = gemm.mm(xe, w1e)
            gate, up = he.chunk(2, -1)
            ae = F.silu(gate).mul_(up)
            gemm.mm(ae, w2e, out=oe)
            saved += [he, ae]
        ctx.save_for_backward(x, w1, w2, *saved)
        ctx.splits, ctx.gemm = splits, gemm
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        x, w1, w2, *saved = ctx.saved_tensors
        gemm = ctx.gemm
        grad = grad.contiguous()
        grad_x, grad_w1, grad_w2 = torch.empty_like(x), torch.empty_like(w1), torch.empty_like(w2)
        blocks = zip(x.split(ctx.splits), grad.split(ctx.splits), grad_x.split(ctx.splits), w1.unbind(0),
                     w2.unbind(0), grad_w1.unbind(0), grad_w2.unbind(0), saved[0::2], saved[1::2])
        for xe, ge, gxe, w1e, w2e, gw1e, gw2e, he, ae in blocks:
            gemm.mm(ae.t(), ge, out=gw2e)
            grad_a = gemm.mm(ge, w2e.t())
            grad_h = torch.empty_like(he)
            _swiglu_backward(he, grad_a, grad_h)
            gemm.mm(xe.t(), grad_h, out=gw1e)
            gemm.mm(grad_h, w1e.t(), out=gxe)
        return grad_x, grad_w1, grad_w2, None, None


def grouped_mm_supported(in_features: int, out_features: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward here for ``[M, in] x [E, in, out]``."""
    key = (in_features, out_features, dtype, torch.device(device).type)
    if key not in _PROBED:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                a = torch.zeros(2, in_features, dtype=dtype, device=device, requires_grad=True)
                b = torch.zeros(2, in_features, out_features, dtype=dtype, device=device, requires_grad=True)
                offs = torch.tensor([1, 2], dtype=torch.int32, device=device)
                torch._grouped_mm(a, b, offs=offs).backward(torch.ones(2, out_features, dtype=dtype, device=device))
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _PROBED[key] = ok
    return _PROBED[key]


def is_expert_param(param: torch.Tensor) -> bool:
    """True for the weights of :class:`GroupedExperts` (split over the ep group, not replicated over dp);
    :func:`mg_parallel.tags.is_expert_parallel`."""
    return is_expert_parallel(param)


def expert_shard_info(param: torch.Tensor, *, tp_size: int = 1, tp_rank: int = 0) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The global shape of an expert parameter and the offset of this rank's block in it.

    Dim 0 (experts) is scaled to ``param.num_experts`` at offset ``param.ep_rank * E_local``; a
    parameter tagged ``tensor_parallel`` is also scaled by ``tp_size`` along ``param.partition_dim``
    (:func:`mg_parallel.tags.global_block` of an expert parameter).

    Raises:
        ValueError: ``param`` is not an expert parameter (see :func:`is_expert_param`).
    """
    expert_layout(param)  # raises for a parameter that is not an expert's
    return global_block(param, tp_size, tp_rank)


def allreduce_expert_grads(modules: Iterable[nn.Module], grid: object) -> None:
    """Average the expert parameters' gradients the way data parallelism averages the others.

    An expert's gradient on one rank already sums the losses of its ep group's micro-batches; summing it
    over ``grid.expert_dp_group`` and dividing by ``dp*cp`` gives the mean over every data-parallel
    micro-batch, as a dense weight's gradient averaged over ``dp_cp_group``. Reads and writes
    ``param.main_grad`` where DDP gave one, else ``.grad``; parameters without a gradient are skipped.
    Collective over ``grid.expert_dp_group``. Use it for models trained without DDP, or from a wrapper
    that leaves expert parameters out of its own reduction (:func:`is_expert_param`).
    """
    grads = [g for p in unique_params(modules) if is_expert_param(p) and (g := grad_of(p)) is not None]
    all_reduce_coalesced(grads, grid.expert_dp_group)
    ranks = grid.dp_size * grid.cp_size
    for g in grads:
        g.div_(ranks)


class GroupedExperts(nn.Module):
    """``E_local`` expert MLPs computed on rows already grouped by expert.

    Args:
        num_experts: global expert count ``N``; ``ep_size`` must divide it.
        hidden_size, ffn_hidden_size: ``h`` and each expert's full ``f``.
        activation: ``"swiglu"`` or ``"gelu"``.
        ep_size, ep_rank: the expert-parallel layout (this rank holds experts
            ``[ep_rank * N/ep, (ep_rank + 1) * N/ep)``).
        tp_group: the expert tensor-parallel group (None: whole experts); each expert's ``f`` is split
            over it and the outputs summed, so the input rows must be the same on every rank of it.
        sequence_parallel: the rows are one tp rank's share of the tokens and the weights are the same on
            every tp rank (tags them ``sequence_parallel``: their gradients are partial sums over tp).
        grouped: force the ``grouped_mm`` (True) or ``loop`` (False) path; None chooses.
        init_method: fills each full ``[N, ...]`` weight (default ``normal(0, 0.02)``) before the slice is kept.
        gemm: the GEMM recipe of every expert matmul, forward and backward (``self.gemm``).

    Raises:
        ValueError: ``ep_size`` does not divide ``num_experts`` (names model.num_experts and parallel.ep),
            or the tp size does not divide ``f``; ``grouped=True`` where ``_grouped_mm`` does not run.
    """

    def __init__(
        self, num_experts: int, hidden_size: int, ffn_hidden_size: int, *, activation: str = "swiglu",
        ep_size: int = 1, ep_rank: int = 0, tp_group: dist.ProcessGroup | None = None, sequence_parallel: bool = False,
        grouped: bool | None = None, init_method: Callable[[torch.Tensor], None] | None = None,
        dtype: torch.dtype | None = None, device: torch.device | str | None = None, gemm: Gemm = PLAIN_GEMM,
    ) -> None:
        super().__init__()
        self.gemm = gemm
        if num_experts % ep_size != 0:
            raise ValueError(
                f"model.num_experts={num_experts} is not divisible by parallel.ep={ep_size}; "
                f"choose an ep that divides {num_experts}"
            )
        tp, tp_rank = group_size(tp_group), group_rank(tp_group)
        if ffn_hidden_size % tp != 0:
            raise ValueError(
                f"the expert FFN size {ffn_hidden_size} is not divisible by parallel.etp={tp}; change either"
            )
        self.num_experts, self.num_local_experts = num_experts, num_experts // ep_size
        self.activation, self.tp_group = activation, tp_group
        e, f = self.num_local_experts, ffn_hidden_size // tp
        gated = activation == "swiglu"
        init = init_method or (lambda w: nn.init.normal_(w, std=0.02))
        full_shapes = {"w1": (num_experts, hidden_size, *((2,) if gated else ()), ffn_hidden_size),
                       "w2": (num_experts, ffn_hidden_size, hidden_size)}
        for name, shape in full_shapes.items():
            f_dim = len(shape) - 1 if name == "w1" else 1
            if torch.device(device or "cpu").type == "meta":
                local = torch.empty(e, *shape[1:f_dim], f, *shape[f_dim + 1 :], dtype=dtype, device="meta")
            else:
                full = torch.empty(shape, dtype=torch.float32)
                init(full)
                local = full.narrow(0, ep_rank * e, e).narrow(f_dim, tp_rank * f, f).to(dtype=dtype, device=device)
            p = nn.Parameter(local.contiguous())
            set_expert_parallel(p, num_experts, ep_rank)
            p.tensor_parallel = tp > 1
            if tp > 1:
                p.partition_dim = f_dim
            if sequence_parallel:
                p.sequence_parallel = True
            self.register_parameter(name, p)
        # auto: grouped_mm off the CPU; on the CPU torch runs it one group at a time, and the loop (with SwiGLU
        # fused per expert) measured faster (benchmarks/bench_moe.py), so there is nothing to probe
        wanted = self.w1.device.type != "cpu" if grouped is None else grouped
        in1, out1 = hidden_size, (2 if gated else 1) * f
        supported = wanted and grouped_mm_supported(in1, out1, self.w1.dtype, self.w1.device) and grouped_mm_supported(
            f, hidden_size, self.w1.dtype, self.w1.device)
        if grouped and not supported:
            raise ValueError("moe_grouped_gemm=True but torch._grouped_mm does not run for these weights here; "
                             "set it to null (auto) or false")
        self.path = "grouped_mm" if supported else "loop"

    def _mm(self, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, splits: list[int] | None) -> torch.Tensor:
        if w.dtype != x.dtype:  # e.g. under autocast, where the activations arrive in the autocast dtype
            w = w.to(x.dtype)
        if self.path == "grouped_mm":
            offs = torch.cumsum(counts, 0).to(torch.int32)
            return _ContiguousGrad.apply(self.gemm.grouped_mm(x, w, offs))
        return _LoopedMM.apply(x.contiguous(), w.contiguous(), splits, self.gemm)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``x [M, h]`` grouped by local expert with ``tokens_per_expert [E_local]`` rows each -> ``[M, h]``."""
        x = copy_to_tp_region(x, self.tp_group)
        splits = None if self.path == "grouped_mm" else tokens_per_expert.tolist()
        w1 = self.w1.flatten(2)  # [E, h, 2f] for SwiGLU: gate columns then up columns
        if self.path == "loop" and self.activation == "swiglu":
            w1, w2 = (w.to(x.dtype).contiguous() for w in (w1, self.w2))  # e.g. under autocast
            y = _LoopedSwiGLU.apply(x.contiguous(), w1, w2, splits, self.gemm)
        else:
            h = self._mm(x, w1, tokens_per_expert, splits)
            h = _SwiGLU.apply(h) if self.activation == "swiglu" else F.gelu(h)
            y = self._mm(h, self.w2, tokens_per_expert, splits)
        return reduce_from_tp_region(y, self.tp_group)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, local={self.num_local_experts}, activation={self.activation}, "
                f"path={self.path}")
