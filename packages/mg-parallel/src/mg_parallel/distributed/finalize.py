"""Gradient finalisation after the last micro-batch's backward, before the optimizer step."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from mg_parallel.grid import ProcessGrid

__all__ = ["finalize_model_grads", "grad_of"]


def grad_of(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient the optimizer uses: ``param.main_grad`` when DDP gave it one, else ``.grad``."""
    g = getattr(param, "main_grad", None)
    return g if g is not None else param.grad


def _all_reduce_coalesced(grads: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    if group is None or dist.get_world_size(group) == 1 or not grads:
        return
    # One collective per dtype instead of one per tensor.
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in same:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _unique_params(model_chunks: Iterable[nn.Module]) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for chunk in model_chunks:
        for p in chunk.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def finalize_model_grads(model_chunks: Sequence[nn.Module], grid: ProcessGrid) -> None:
    """Make every gradient final: data-parallel sync, then tensor- and pipeline-parallel fix-ups.

    1. ``finish_grad_sync()`` on every chunk that has it (DDP-wrapped chunks): waits for (or
       issues) each bucket's all-reduce / reduce-scatter over the data-parallel group.
    2. Parameters marked ``sequence_parallel`` (replicated norms, row-parallel biases) have
       partial gradients on each tensor-parallel rank under sequence parallelism: their
       gradients are summed over ``grid.tp_group``.
    3. Parameters marked ``shared_embedding`` (a word embedding tied to the output layer on
       another pipeline stage) are summed over ``grid.embedding_group`` (first and last stage;
       nothing happens when ``pp == 1``).

    Steps 2 and 3 are linear, so they commute with the data-parallel average; with the
    distributed optimizer only this rank's shard of each bucket is meaningful afterwards, and
    tp/pp peers agree on where that shard is (shared embeddings get a bucket of their own).

    Args:
        model_chunks: this rank's model chunks (usually ``DistributedDataParallel`` wrappers).
        grid: the process grid.
    """
    for chunk in model_chunks:
        finish = getattr(chunk, "finish_grad_sync", None)
        if finish is not None:
            finish()
    params = _unique_params(model_chunks)
    sp = [g for p in params if getattr(p, "sequence_parallel", False) and (g := grad_of(p)) is not None]
    _all_reduce_coalesced(sp, grid.tp_group)
    if grid.pp_size > 1 and (grid.is_first_stage or grid.is_last_stage):
        shared = [g for p in params if getattr(p, "shared_embedding", False) and (g := grad_of(p)) is not None]
        _all_reduce_coalesced(shared, grid.embedding_group)
