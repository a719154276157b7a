"""Autograd communication of the token dispatchers (the MoE counterpart of ``tensor_parallel.mappings``).

:func:`all_to_all` is its own adjoint with the split sizes swapped: what rank ``a`` sent to rank
``b`` in forward, ``b`` sends back to ``a`` in backward. The all-gather dispatcher reuses the
sequence-parallel gather / reduce-scatter of ``tensor_parallel.mappings`` over the ep group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mg_parallel.tensor_parallel.utils import group_size

__all__ = ["all_to_all", "exchange_counts"]


def _a2a(x: torch.Tensor, group: dist.ProcessGroup, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Variable-size all-to-all along dim 0; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return _a2a(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _a2a(grad, ctx.group, ctx.in_splits, ctx.out_splits), None, None, None


def all_to_all(
    x: torch.Tensor, group: dist.ProcessGroup | None, out_splits: list[int], in_splits: list[int]
) -> torch.Tensor:
    """Send rows ``[sum(in_splits[:r]), +in_splits[r])`` of ``x`` to rank ``r`` of ``group``; receive
    ``out_splits[r]`` rows from each rank ``r``, concatenated in rank order. ``x``: ``[sum(in_splits), ...]``.

    Differentiable; the identity when ``group`` has one rank.
    """
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, list(out_splits), list(in_splits))


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's token counts for this rank's experts.

    Args:
        counts: ``[ep * E_local]`` tokens this rank sends to each global expert (int64).

    Returns:
        ``[ep, E_local]``: row ``r`` holds what rank ``r`` sends to this rank's local experts.
    """
    ep = group_size(group)
    if ep == 1:
        return counts.view(1, -1)
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out.view(ep, -1)
