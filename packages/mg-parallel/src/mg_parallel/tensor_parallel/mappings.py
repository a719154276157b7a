"""Autograd communication for tensor and sequence parallelism.

Every cross-rank exchange of the tensor-parallel layers lives here, as a pair of collectives
(one in forward, its adjoint in backward), so the layers read as plain maths. In the notation
of the Megatron-LM paper (Shoeybi et al., 2019, section 3):

* ``f`` = :func:`copy_to_tp_region`: identity forward, all-reduce backward. It enters a
  tensor-parallel region whose input is replicated on every rank.
* ``g`` = :func:`reduce_from_tp_region`: all-reduce forward, identity backward. It leaves a
  region whose ranks each produced a partial sum.

Sequence parallelism (Korthikanti et al., 2022, section 4.2.2) replaces them by collectives
along the sequence dimension (dim 0 of ``[seq, batch, hidden]`` activations): that paper's
``g`` = :func:`gather_from_sequence_parallel_region` (all-gather forward, reduce-scatter
backward) takes the place of ``f``, and its ``g-bar`` =
:func:`reduce_scatter_to_sequence_parallel_region` (reduce-scatter forward, all-gather
backward) takes the place of Megatron's ``g``.

When ``group`` is None or has one rank every function returns its input unchanged, without an
autograd node or a copy, so tensor-parallel size 1 costs nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mg_parallel.collectives import all_gather_into_tensor, reduce_scatter_tensor
from mg_parallel.tensor_parallel.utils import group_rank, group_size

__all__ = [
    "all_gather_dim0",
    "copy_to_tp_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tp_region",
    "reduce_from_tp_region",
    "reduce_scatter_dim0",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tp_region",
]

# --- raw collectives (no autograd) -------------------------------------------------------------


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    # The input may be referenced elsewhere in the graph: reduce a private copy.
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def all_gather_dim0(
    x: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
) -> torch.Tensor | tuple[torch.Tensor, dist.Work]:
    """Concatenate every rank's ``x`` along dim 0 (no autograd).

    Returns the gathered tensor ``[world * x.shape[0], ...]``, or ``(tensor, work)`` with
    ``async_op=True`` (call ``work.wait()`` before reading the tensor).
    """
    world = group_size(group)
    x = x.contiguous()
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = all_gather_into_tensor(out, x, group=group, async_op=async_op)
    return (out, work) if async_op else out


def reduce_scatter_dim0(
    x: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
) -> torch.Tensor | tuple[torch.Tensor, dist.Work]:
    """Sum ``x`` over ranks and keep this rank's slice of dim 0 (no autograd).

    Raises:
        ValueError: ``x.shape[0]`` is not divisible by the group size.
    """
    world = group_size(group)
    if x.shape[0] % world != 0:
        raise ValueError(
            f"sequence length {x.shape[0]} is not divisible by the tensor-parallel size {world}; "
            f"with sequence parallelism choose a sequence length that is a multiple of tp"
        )
    x = x.contiguous()
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = reduce_scatter_tensor(out, x, group=group, async_op=async_op)
    return (out, work) if async_op else out


def _split_last(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    world, rank = group_size(group), group_rank(group)
    last = x.shape[-1]
    if last % world != 0:
        raise ValueError(
            f"last dimension {last} is not divisible by the tensor-parallel size {world}; "
            f"choose a hidden size that is a multiple of tp"
        )
    part = last // world
    return x.narrow(-1, rank * part, part).contiguous()


def _gather_last(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    # Gather along the contiguous dim 0 of a [world, ...] buffer, then lay parts side by side.
    stacked = all_gather_dim0(x.unsqueeze(0), group)
    return torch.cat(stacked.unbind(0), dim=-1)


def _split_first(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    world, rank = group_size(group), group_rank(group)
    if x.shape[0] % world != 0:
        raise ValueError(
            f"sequence length {x.shape[0]} is not divisible by the tensor-parallel size {world}; "
            f"with sequence parallelism choose a sequence length that is a multiple of tp"
        )
    part = x.shape[0] // world
    return x.narrow(0, rank * part, part).contiguous()


# --- autograd functions --------------------------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's ``g``: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, inplace: bool) -> torch.Tensor:
        if inplace and x.is_contiguous():
            dist.all_reduce(x, group=group)
            ctx.mark_dirty(x)
            return x
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class _ScatterToTP(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward; all-gather it backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_last(grad, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    """All-gather the last dim forward; keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_last(grad, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    """Keep this rank's slice of the sequence dim forward; all-gather it backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _split_first(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_gather_dim0(grad, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    """Sequence-parallel ``f``: all-gather the sequence dim forward, reduce-scatter backward.

    When the consumer of the gathered tensor is replicated (its gradient is already complete
    on every rank), backward only splits instead of summing.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, partial_grad: bool) -> torch.Tensor:
        ctx.group = group
        ctx.partial_grad = partial_grad
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.partial_grad:
            return reduce_scatter_dim0(grad, ctx.group), None, None
        return _split_first(grad, ctx.group), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    """Sequence-parallel ``g``: reduce-scatter the sequence dim forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_gather_dim0(grad, ctx.group), None


# --- public API ----------------------------------------------------------------------------------


def copy_to_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Megatron's ``f``: enter a tensor-parallel region with a replicated input.

    Forward is the identity; backward all-reduces (sums) the gradient over ``group``, because
    every rank's partial computation used the whole input. Any shape.
    """
    if group_size(group) == 1:
        return x
    return _CopyToTP.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None, *, inplace: bool = False) -> torch.Tensor:
    """Megatron's ``g``: leave a tensor-parallel region by summing the ranks' partial outputs.

    Forward all-reduces (sums) ``x`` over ``group``; backward is the identity. Any shape.
    ``inplace=True`` reduces into ``x`` itself (saving a copy); only valid when nothing else
    needs ``x``'s values, e.g. a fresh matmul output that its own backward does not read.
    """
    if group_size(group) == 1:
        return x
    return _ReduceFromTP.apply(x, group, inplace)


def scatter_to_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Split the last dim: ``[..., h] -> [..., h/tp]`` (this rank's part); backward all-gathers.

    Raises:
        ValueError: ``h`` is not divisible by the group size.
    """
    if group_size(group) == 1:
        return x
    return _ScatterToTP.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather the last dim: ``[..., h/tp] -> [..., h]`` in rank order; backward splits."""
    if group_size(group) == 1:
        return x
    return _GatherFromTP.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Split dim 0 (sequence): ``[s, ...] -> [s/tp, ...]``; backward all-gathers.

    Raises:
        ValueError: ``s`` is not divisible by the group size.
    """
    if group_size(group) == 1:
        return x
    return _ScatterToSP.apply(x, group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: dist.ProcessGroup | None, *, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """Sequence-parallel ``f``: all-gather dim 0 ``[s/tp, ...] -> [s, ...]``; backward reduce-scatters.

    Used before a column-parallel layer: every rank needs the whole sequence, and each rank's
    input gradient is a partial sum over the hidden shards, so backward sums and re-splits it.

    Args:
        x: this rank's sequence shard ``[s/tp, ...]``.
        group: tensor-parallel group (None: identity).
        tensor_parallel_output_grad: the gradient arriving in backward is a per-rank partial
            sum (true before a tensor-parallel layer). Pass False when the gathered tensor
            feeds replicated computation (e.g. the final output used identically on every
            rank): backward then just keeps this rank's slice.
    """
    if group_size(group) == 1:
        return x
    return _GatherFromSP.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sequence-parallel ``g``: sum over ranks and keep this rank's ``[s/tp, ...]`` slice of dim 0.

    Used after a row-parallel layer in place of the all-reduce; backward all-gathers.

    Raises:
        ValueError: ``s`` is not divisible by the group size.
    """
    if group_size(group) == 1:
        return x
    return _ReduceScatterToSP.apply(x, group)
