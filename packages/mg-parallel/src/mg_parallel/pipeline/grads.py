"""Gradient and loss reductions that a pipelined training step needs after the schedule."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mg_parallel.collectives import all_reduce_coalesced
from mg_parallel.grid import ProcessGrid
from mg_parallel.params import grad_of, unique_params
from mg_parallel.tags import is_pipeline_replicated, is_shared_embedding

__all__ = ["allreduce_pipeline_replicated_grads", "allreduce_shared_embedding_grads", "average_losses"]


def allreduce_shared_embedding_grads(model_chunks: Sequence[nn.Module], grid: ProcessGrid) -> None:
    """Sum the gradients of ``shared_embedding`` parameters over the first and last stage.

    A tied word embedding is held twice with pp > 1: by the first stage (input embedding) and
    by the last (output projection), each parameter marked ``param.shared_embedding = True``.
    Summing their gradients over ``grid.embedding_group`` gives both copies the gradient of the
    tied weight, so identical optimizer steps keep them equal. No-op when pp == 1 (the weight is
    one parameter) and on middle stages. Reads ``param.main_grad`` when DDP gave one, else
    ``param.grad`` (a missing ``.grad`` counts as zeros and is set to the sum).

    Raises:
        RuntimeError: the first and last stage hold different numbers of shared-embedding
            elements (mark exactly the tied weight on both).
    """
    if grid.embedding_group is None or not (grid.is_first_stage or grid.is_last_stage):
        return
    _sum_tagged_grads(model_chunks, grid, "shared_embedding", is_shared_embedding, grid.embedding_group, lambda count: (
        f"pipeline rank {grid.pp_rank} holds {count} shared_embedding elements but the other end of the embedding "
        f"group differs; mark the tied word embedding with param.shared_embedding = True on both the first and the "
        f"last stage (or on neither)"))


def allreduce_pipeline_replicated_grads(model_chunks: Sequence[nn.Module], grid: ProcessGrid) -> None:
    """Sum the gradients of ``pipeline_replicated`` parameters over the pipeline-parallel group.

    A parameter that every stage holds (in the same order and shape), though only some use it, is
    marked ``param.pipeline_replicated = True`` (T5's relative position bias tables, read by the
    layers of a stack wherever they are). Summing over ``grid.pp_group`` gives every copy the
    gradient of the one parameter, so identical optimizer steps keep the copies equal. No-op when
    pp == 1. Reads ``param.main_grad`` when DDP gave one, else ``param.grad`` (a missing ``.grad``
    counts as zeros and is set to the sum).

    Raises:
        RuntimeError: the stages hold different numbers of pipeline-replicated elements.
    """
    if grid.pp_group is None or grid.pp_size == 1:
        return
    _sum_tagged_grads(model_chunks, grid, "pipeline_replicated", is_pipeline_replicated, grid.pp_group, lambda count: (
        f"pipeline rank {grid.pp_rank} holds {count} pipeline_replicated elements but another stage differs; every "
        f"stage must hold the same parameters marked param.pipeline_replicated = True"))


def _sum_tagged_grads(model_chunks: Sequence[nn.Module], grid: ProcessGrid, tag: str,
                      tagged: Callable[[torch.Tensor], bool], group: Any, mismatch: Any) -> None:
    """Sum the gradients of the parameters tagged ``tag`` (``tagged(p)``) over ``group`` (a missing gradient counts
    as zeros)."""
    params = [p for p in unique_params(model_chunks) if tagged(p)]
    grads = [grad_of(p) for p in params]
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
    count = sum(g.numel() for g in grads)
    # One tiny collective, once per model, so a mismatch is an error rather than a hang in the real reduction.
    checked = f"_{tag}_count"
    if getattr(model_chunks[0], checked, None) != count:
        sizes = torch.tensor([count, -count], dtype=torch.int64, device=grid.device)
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
        if sizes[0].item() != count or -sizes[1].item() != count:
            raise RuntimeError(mismatch(count))
        setattr(model_chunks[0], checked, count)
    if not params:
        return
    all_reduce_coalesced(grads, group)
    for p, g in zip(params, grads):
        if grad_of(p) is None:
            p.grad = g


def average_losses(losses: Sequence[dict[str, Any]], grid: ProcessGrid, key: str = "loss", *,
                   host_sync: bool = True) -> float | torch.Tensor:
    """The mean of ``key`` over the microbatches and data-parallel replicas, on every rank.

    ``losses`` is what a schedule returned (non-empty on the last pipeline stage only). The
    last stage's mean is broadcast along the pipeline and averaged over ``grid.dp_cp_group``,
    so every rank, including the logger on global rank 0, reports the same number; with
    ``host_sync=False`` as a 0-dim float64 tensor on the device, read by nobody yet.
    Collective: call it on every rank.

    Raises:
        ValueError: the last stage has no losses (``num_microbatches`` was 0).
    """
    value = torch.zeros(1, dtype=torch.float64, device=grid.device)
    if grid.is_last_stage:
        if not losses:
            raise ValueError("average_losses: the last pipeline stage has no microbatch losses to average")
        # Summed on the device: no host read per micro-batch.
        value += torch.stack([torch.as_tensor(item[key], dtype=torch.float64, device=grid.device).reshape(())
                              for item in losses]).sum() / len(losses)
    if grid.pp_group is not None and grid.pp_size > 1:
        dist.broadcast(value, src=grid.pp_ranks[-1], group=grid.pp_group)
    if grid.dp_cp_group is not None and grid.dp_size * grid.cp_size > 1:
        dist.all_reduce(value, group=grid.dp_cp_group)
        value /= grid.dp_size * grid.cp_size
    return float(value.item()) if host_sync else value[0]
