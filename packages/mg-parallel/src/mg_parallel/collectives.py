"""Flat-tensor collectives under this torch version's names, and a coalesced all-reduce.

Every module of mg-parallel that needs them imports them from here, so a torch rename is handled
once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["all_gather_into_tensor", "all_reduce_coalesced", "reduce_scatter_tensor"]

# torch 2.13 renamed the flat-tensor collectives; keep working on older releases too.
all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``(output, input, group=None, async_op=False)``: concatenate every rank's ``input`` into ``output``."""
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""``(output, input, group=None, async_op=False)``: sum ``input`` over ranks, keep this rank's part."""


def all_reduce_coalesced(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Sum every tensor of ``tensors`` over ``group`` in place, with one all-reduce per dtype.

    The tensors of one dtype are flattened into one buffer, reduced and copied back, so many small
    gradients cost one collective. Any shapes; the tensors need not be contiguous. No-op for a
    group of None or of one rank, and for an empty list. Collective: every rank of ``group`` must
    pass tensors of the same dtypes and sizes in the same order.
    """
    if group is None or dist.get_world_size(group) == 1 or not tensors:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, group=group)
        offset = 0
        for t in same:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
