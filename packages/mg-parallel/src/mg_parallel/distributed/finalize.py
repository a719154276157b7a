"""Gradient finalisation after the last micro-batch's backward, before the optimizer step."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from mg_parallel.grid import ProcessGrid
from mg_parallel.params import grad_of
from mg_parallel.pipeline.grads import allreduce_pipeline_replicated_grads, allreduce_shared_embedding_grads
from mg_parallel.tensor_parallel.layers import allreduce_sequence_parallel_grads

__all__ = ["finalize_model_grads", "grad_of"]


def finalize_model_grads(model_chunks: Sequence[nn.Module], grid: ProcessGrid) -> None:
    """Make every gradient final: data-parallel sync, then tensor- and pipeline-parallel fix-ups.

    1. ``finish_grad_sync()`` on every chunk that has it (DDP-wrapped chunks): waits for (or
       issues) each bucket's all-reduce / reduce-scatter over the data-parallel group. With more
       than one data/context-parallel rank every chunk must be wrapped (torch's own
       ``DistributedDataParallel``, which reduces during backward, is accepted too).
    2. Parameters marked ``sequence_parallel`` (replicated norms, row-parallel biases) have
       partial gradients on each tensor-parallel rank under sequence parallelism: their
       gradients are summed over ``grid.tp_group``.
    3. Parameters marked ``shared_embedding`` (a word embedding tied to the output layer on
       another pipeline stage) are summed over ``grid.embedding_group`` (first and last stage;
       nothing happens when ``pp == 1``), and parameters marked ``pipeline_replicated`` (held by every
       stage) over ``grid.pp_group``.

    Steps 2 and 3 are linear, so they commute with the data-parallel average; with the
    distributed optimizer only this rank's shard of each bucket is meaningful afterwards, and
    tp/pp peers agree on where that shard is (shared embeddings and pipeline-replicated parameters get a
    bucket of their own).

    Args:
        model_chunks: this rank's model chunks (usually ``DistributedDataParallel`` wrappers).
        grid: the process grid.

    Raises:
        ValueError: dp * cp > 1 and a chunk is not wrapped for data parallelism (its gradients
            would silently stay per-replica); raised on every rank before any communication.
    """
    replicas = grid.dp_size * grid.cp_size
    if replicas > 1:
        for i, chunk in enumerate(model_chunks):
            if not (hasattr(chunk, "finish_grad_sync") or isinstance(chunk, nn.parallel.DistributedDataParallel)):
                raise ValueError(
                    f"model chunk {i} is a {type(chunk).__name__}, not wrapped in "
                    f"mg_parallel.distributed.DistributedDataParallel, so with dp*cp={replicas} its gradients would "
                    f"not be averaged over the data-parallel ranks; wrap every chunk before training"
                )
    for chunk in model_chunks:
        finish = getattr(chunk, "finish_grad_sync", None)
        if finish is not None:
            finish()
    allreduce_sequence_parallel_grads(model_chunks, grid.tp_group)
    allreduce_shared_embedding_grads(model_chunks, grid)
    allreduce_pipeline_replicated_grads(model_chunks, grid)
