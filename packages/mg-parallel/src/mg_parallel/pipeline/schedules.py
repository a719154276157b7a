"""Forward/backward schedules over microbatches: no pipelining, 1F1B and interleaved 1F1B.

All three have one signature and are picked by :func:`get_forward_backward_func`::

    losses = forward_backward(forward_step, data_iterator, model_chunks, num_microbatches, grid,
                              tensor_shape=(seq, micro_batch, hidden), dtype=torch.float32)

The user's ``forward_step(batch, model) -> (output, loss_fn)`` runs one microbatch through one
model chunk; ``loss_fn(output) -> (loss, logs)`` is only called on the last (virtual) stage.
Chunks read their input from ``set_input_tensor`` on every stage but the first, and return the
hidden tensor to send on every stage but the last. Each microbatch's loss is divided by
``num_microbatches`` before backward, so gradients are the mean over microbatches, and scaled by
``scale_loss`` (fp16 loss scaling) if given. The returned list holds, on the last stage, one
``{"loss": loss, **logs}`` per microbatch (unscaled, detached); it is empty elsewhere (use
:func:`mg_parallel.pipeline.average_losses` for a number every rank agrees on).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from mg_parallel.grid import ProcessGrid
from mg_parallel.pipeline.p2p import PendingRecv, ensure_p2p_ready, post_step
from mg_parallel.pipeline.recorder import Recorder
from mg_parallel.pipeline.timetable import Message, pipeline_plan

__all__ = [
    "ForwardStep",
    "finalize_model_grads",
    "forward_backward_1f1b",
    "forward_backward_interleaved",
    "forward_backward_no_pipelining",
    "get_forward_backward_func",
]

LossFn = Callable[[Any], tuple[torch.Tensor, dict[str, Any]]]
ForwardStep = Callable[[Any, nn.Module], tuple[Any, LossFn]]
DataIterator = Iterator[Any] | Sequence[Iterator[Any] | None] | None
Finalize = Callable[[list[nn.Module], ProcessGrid], None]


def finalize_model_grads(model_chunks: list[nn.Module], grid: ProcessGrid) -> None:
    """The default gradient finalisation after a schedule's last backward:
    :func:`mg_parallel.distributed.finalize_model_grads` (DDP sync, sequence-parallel and tied
    embedding reductions)."""
    # Imported here: mg_parallel.distributed imports this package (the tied-embedding reduction).
    from mg_parallel.distributed import finalize_model_grads as full

    full(model_chunks, grid)


def _as_chunks(model_chunks: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    return [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)


def _set_input_tensor(chunk: nn.Module, tensor: torch.Tensor | None) -> None:
    module: Any = chunk
    while not hasattr(module, "set_input_tensor"):
        module = getattr(module, "module", None)  # look through wrappers such as DDP
        if module is None:
            raise TypeError(
                f"model chunk {type(chunk).__name__} has no set_input_tensor(tensor) method; pipeline stages "
                f"after the first read their input from it, so add one to the chunk's module"
            )
    module.set_input_tensor(tensor)


class _Batches:
    """Hands each (chunk, microbatch) its batch: one iterator per chunk, or one shared by all chunks."""

    def __init__(self, data_iterator: DataIterator, num_chunks: int) -> None:
        if data_iterator is None or not isinstance(data_iterator, (list, tuple)):
            self.shared: Any = data_iterator
            self.per_chunk: list[Any] | None = None
        else:
            if len(data_iterator) != num_chunks:
                raise ValueError(
                    f"data_iterator is a list of {len(data_iterator)} iterators but there are {num_chunks} "
                    f"model chunks; pass one iterator per chunk or a single iterator"
                )
            self.per_chunk = list(data_iterator)
        self.cache: dict[int, Any] = {}
        self.fetched = 0
        self.num_chunks = num_chunks

    def get(self, chunk: int, microbatch: int) -> Any:
        if self.per_chunk is not None:
            it = self.per_chunk[chunk]
            return None if it is None else next(it)
        if self.shared is None:
            return None
        while self.fetched <= microbatch:  # microbatches start in increasing order on every chunk
            self.cache[self.fetched] = next(self.shared)
            self.fetched += 1
        return self.cache[microbatch]

    def release(self, chunk: int, microbatch: int) -> None:
        if chunk == self.num_chunks - 1:
            self.cache.pop(microbatch, None)


def _sync_contexts(chunks: list[nn.Module]) -> list[contextlib.ExitStack]:
    # DDP's no_sync() defers the gradient reduction to the last microbatch; plain modules have none.
    stacks = []
    for chunk in chunks:
        stack = contextlib.ExitStack()
        if hasattr(chunk, "no_sync"):
            stack.enter_context(chunk.no_sync())
        stacks.append(stack)
    return stacks


def _check_common(num_microbatches: int, chunks: list[nn.Module]) -> None:
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    if not chunks:
        raise ValueError("model_chunks is empty; pass the rank's model (or its list of chunks)")


def _loss_for_backward(
    loss: torch.Tensor, num_microbatches: int, scale_loss: Callable[[torch.Tensor], torch.Tensor] | None
) -> torch.Tensor:
    loss = loss / num_microbatches
    return scale_loss(loss) if scale_loss is not None else loss


def forward_backward_no_pipelining(
    forward_step: ForwardStep,
    data_iterator: DataIterator,
    model_chunks: nn.Module | Sequence[nn.Module],
    num_microbatches: int,
    grid: ProcessGrid,
    *,
    tensor_shape: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
    forward_only: bool = False,
    scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
    recorder: Recorder | None = None,
    finalize_grads: Finalize | None = finalize_model_grads,
) -> list[dict[str, Any]]:
    """Gradient accumulation over microbatches on one stage (pp == 1); arguments as in 1F1B.

    The model's ``no_sync()`` (DDP) is entered for all microbatches but the last, so the
    data-parallel reduction runs once, during the last backward. ``tensor_shape`` is unused.

    Raises:
        ValueError: pp > 1, more than one model chunk, or ``num_microbatches < 1``.
    """
    del tensor_shape, dtype  # nothing is communicated between stages
    chunks = _as_chunks(model_chunks)
    _check_common(num_microbatches, chunks)
    if grid.pp_size != 1 or len(chunks) != 1:
        raise ValueError(
            f"forward_backward_no_pipelining needs parallel.pp=1 and one model chunk (got pp={grid.pp_size}, "
            f"{len(chunks)} chunks); use get_forward_backward_func(grid, virtual_pipeline_size) to pick a schedule"
        )
    model = chunks[0]
    batches = _Batches(data_iterator, 1)
    losses: list[dict[str, Any]] = []
    for mb in range(num_microbatches):
        last = mb == num_microbatches - 1
        sync = contextlib.nullcontext() if last or forward_only or not hasattr(model, "no_sync") else model.no_sync()
        with sync, (torch.no_grad() if forward_only else contextlib.nullcontext()):
            t0 = time.time()
            output, loss_fn = forward_step(batches.get(0, mb), model)
            loss, logs = loss_fn(output)
            t1 = time.time()
            if recorder is not None:
                recorder(grid.pp_rank, 0, mb, "F", t0, t1)
            losses.append({"loss": loss.detach(), **logs})
            if not forward_only:
                _loss_for_backward(loss, num_microbatches, scale_loss).backward()
                if recorder is not None:
                    recorder(grid.pp_rank, 0, mb, "B", t1, time.time())
        batches.release(0, mb)
    if not forward_only and finalize_grads is not None:
        finalize_grads(chunks, grid)
    return losses


def _run_plan(
    forward_step: ForwardStep,
    data_iterator: DataIterator,
    chunks: list[nn.Module],
    num_microbatches: int,
    grid: ProcessGrid,
    tensor_shape: Sequence[int] | None,
    dtype: torch.dtype,
    forward_only: bool,
    scale_loss: Callable[[torch.Tensor], torch.Tensor] | None,
    recorder: Recorder | None,
    finalize_grads: Finalize | None,
) -> list[dict[str, Any]]:
    pp, rank, v = grid.pp_size, grid.pp_rank, len(chunks)
    if tensor_shape is None:
        raise ValueError(
            "tensor_shape is required with pipeline parallelism: the shape of the tensor a stage sends, "
            "e.g. (seq_length, micro_batch_size, hidden_size), with seq_length / tp under sequence parallelism"
        )
    shape = tuple(int(d) for d in tensor_shape)
    last_stage = pp * v - 1
    plan = pipeline_plan(pp, v, num_microbatches, forward_only)[rank]
    last_backward = {}
    for i, step in enumerate(plan):
        if step.op is not None and step.op.kind == "B":
            last_backward[step.op.chunk] = i
    ensure_p2p_ready(grid)
    batches = _Batches(data_iterator, v)
    received: dict[Message, PendingRecv] = {}
    inputs: dict[tuple[int, int], torch.Tensor | None] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    sent: list[tuple[Any, torch.Tensor]] = []
    losses: list[dict[str, Any]] = []
    syncs = [] if forward_only else _sync_contexts(chunks)
    grad_mode = torch.no_grad() if forward_only else contextlib.nullcontext()
    try:
        for i, step in enumerate(plan):
            produced: torch.Tensor | None = None
            op = step.op
            if op is not None:
                key, stage = (op.chunk, op.microbatch), op.chunk * pp + rank
                if op.kind == "F":
                    x = None
                    if stage > 0:
                        x = received.pop(Message("act", stage - 1, op.microbatch)).wait()
                        x.requires_grad_(not forward_only)
                    t0 = time.time()  # after the wait: time spent waiting is bubble, not work
                    with grad_mode:
                        _set_input_tensor(chunks[op.chunk], x)
                        output, loss_fn = forward_step(batches.get(*key), chunks[op.chunk])
                        batches.release(*key)
                        if stage == last_stage:
                            loss, logs = loss_fn(output)
                            losses.append({"loss": loss.detach(), **logs})
                            output = _loss_for_backward(loss, num_microbatches, scale_loss)
                        elif not isinstance(output, torch.Tensor) or tuple(output.shape) != shape:
                            got = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
                            raise ValueError(
                                f"pipeline rank {rank} chunk {op.chunk} returned {got} but tensor_shape={shape}; "
                                f"pass the shape each stage sends (with sequence parallelism: seq_length / tp)"
                            )
                        else:
                            produced = output.detach()
                    if not forward_only:
                        inputs[key], outputs[key] = x, output
                else:
                    if i == last_backward[op.chunk]:
                        syncs[op.chunk].close()  # let DDP reduce during this chunk's last backward
                    output, x = outputs.pop(key), inputs.pop(key)
                    if stage == last_stage:
                        t0 = time.time()
                        torch.autograd.backward(output)
                    else:
                        grad = received.pop(Message("grad", stage + 1, op.microbatch)).wait()
                        t0 = time.time()
                        torch.autograd.backward(output, grad_tensors=grad)
                    del output
                    if stage > 0:
                        produced = x.grad
                        if produced is None:
                            raise RuntimeError(
                                f"pipeline rank {rank} chunk {op.chunk}: the input tensor received no gradient; "
                                f"the chunk must compute its output from the tensor given to set_input_tensor"
                            )
                    del x
                if recorder is not None:
                    recorder(rank, op.chunk, op.microbatch, op.kind, t0, time.time())
            sends = [(peer, produced) for peer, _ in step.sends]
            pending, works = post_step(grid, sends, [(peer, shape, dtype) for peer, _ in step.recvs])
            received.update({msg: p for (_, msg), p in zip(step.recvs, pending)})
            sent += works
            if len(sent) > 8:  # release finished sends so their tensors can be freed
                sent = [(w, t) for w, t in sent if not w.is_completed()]
        for work, _ in sent:
            work.wait()
    finally:
        for stack in syncs:
            stack.close()
    if not forward_only and finalize_grads is not None:
        finalize_grads(chunks, grid)
    return losses if grid.is_last_stage else []


def forward_backward_1f1b(
    forward_step: ForwardStep,
    data_iterator: DataIterator,
    model_chunks: nn.Module | Sequence[nn.Module],
    num_microbatches: int,
    grid: ProcessGrid,
    *,
    tensor_shape: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
    forward_only: bool = False,
    scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
    recorder: Recorder | None = None,
    finalize_grads: Finalize | None = finalize_model_grads,
) -> list[dict[str, Any]]:
    """One-forward-one-backward pipeline schedule (PipeDream-Flush) over ``grid.pp_group``.

    Stage ``r`` of ``p`` runs ``min(p - r - 1, m)`` warm-up forwards, then alternates one
    forward and one backward, then drains the remaining backwards; it never holds more than
    ``min(p - r, m)`` microbatches' activations. Any ``num_microbatches >= 1`` works (fewer than
    ``p`` just leaves a larger bubble).

    Args:
        forward_step: ``forward_step(batch, model) -> (output, loss_fn)``.
        data_iterator: yields one batch per microbatch (``None`` on stages that need no data).
        model_chunks: this rank's stage (a module or a one-element list).
        num_microbatches: microbatches per step.
        grid: the process grid.
        tensor_shape: shape of the activation sent between stages (per rank: ``[s/tp, b, h]``
            under sequence parallelism); gradients have the same shape.
        dtype: dtype of the activations and gradients sent between stages.
        forward_only: evaluation: forward passes only, under ``torch.no_grad()``.
        scale_loss: applied to the last stage's loss before backward (fp16 loss scaling).
        recorder: ``recorder(pp_rank, chunk, microbatch, "F"|"B", t_start, t_end)`` per pass.
        finalize_grads: called as ``finalize_grads(model_chunks, grid)`` after the last backward
            (tied-embedding and data-parallel reductions); ``None`` to skip.

    Returns:
        On the last stage one ``{"loss": ..., **logs}`` per microbatch; ``[]`` elsewhere.

    Raises:
        ValueError: pp == 1, more than one chunk, ``num_microbatches < 1``, no ``tensor_shape``,
            or a stage output whose shape is not ``tensor_shape``.
    """
    chunks = _as_chunks(model_chunks)
    _check_common(num_microbatches, chunks)
    if grid.pp_size < 2 or len(chunks) != 1:
        raise ValueError(
            f"forward_backward_1f1b needs parallel.pp >= 2 and one model chunk (got pp={grid.pp_size}, "
            f"{len(chunks)} chunks); use get_forward_backward_func(grid, virtual_pipeline_size) to pick a schedule"
        )
    return _run_plan(forward_step, data_iterator, chunks, num_microbatches, grid, tensor_shape, dtype,
                     forward_only, scale_loss, recorder, finalize_grads)


def forward_backward_interleaved(
    forward_step: ForwardStep,
    data_iterator: DataIterator,
    model_chunks: nn.Module | Sequence[nn.Module],
    num_microbatches: int,
    grid: ProcessGrid,
    *,
    tensor_shape: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
    forward_only: bool = False,
    scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
    recorder: Recorder | None = None,
    finalize_grads: Finalize | None = finalize_model_grads,
) -> list[dict[str, Any]]:
    """Interleaved 1F1B: ``v = len(model_chunks)`` virtual stages per rank; arguments as in 1F1B.

    Chunk ``c`` of rank ``r`` is virtual stage ``c * p + r``. Microbatches enter in groups of
    ``p``: each group passes through chunk 0, then chunk 1, ... so the bubble shrinks to
    ``(p - 1) / (v * m)`` of the ideal time, at the cost of ``v`` times more messages and up to
    ``2 (p - r - 1) + (v - 1) p + 1`` microbatch-chunks of activations in flight on rank ``r``.
    ``data_iterator`` may be one iterator (each microbatch's batch is shared by the chunks) or
    a list with one iterator per chunk.

    Raises:
        ValueError: pp < 2, fewer than two chunks, or ``num_microbatches`` not a positive
            multiple of pp (and the errors of :func:`forward_backward_1f1b`).
    """
    chunks = _as_chunks(model_chunks)
    _check_common(num_microbatches, chunks)
    p = grid.pp_size
    if p < 2 or len(chunks) < 2:
        raise ValueError(
            f"forward_backward_interleaved needs parallel.pp >= 2 and >= 2 model chunks (got pp={p}, "
            f"{len(chunks)} chunks); with one chunk per rank use forward_backward_1f1b"
        )
    if num_microbatches % p != 0:
        raise ValueError(
            f"the interleaved schedule needs num_microbatches to be a multiple of parallel.pp={p}, got "
            f"{num_microbatches}; use {max(p, num_microbatches // p * p)} or {(num_microbatches // p + 1) * p} "
            f"microbatches, or the non-interleaved 1F1B schedule (virtual_pipeline_size=None)"
        )
    return _run_plan(forward_step, data_iterator, chunks, num_microbatches, grid, tensor_shape, dtype,
                     forward_only, scale_loss, recorder, finalize_grads)


def get_forward_backward_func(
    grid: ProcessGrid, virtual_pipeline_size: int | None = None
) -> Callable[..., list[dict[str, Any]]]:
    """The schedule for this grid: no pipelining (pp == 1), 1F1B, or interleaved (vpp > 1).

    Raises:
        ValueError: ``virtual_pipeline_size`` is not a positive integer, or is > 1 with pp == 1.
    """
    vpp = 1 if virtual_pipeline_size is None else virtual_pipeline_size
    if not isinstance(vpp, int) or vpp < 1:
        raise ValueError(f"virtual_pipeline_size must be None or a positive integer, got {virtual_pipeline_size!r}")
    if grid.pp_size == 1:
        if vpp > 1:
            raise ValueError(
                f"virtual_pipeline_size={vpp} needs parallel.pp >= 2; unset it or increase parallel.pp"
            )
        return forward_backward_no_pipelining
    return forward_backward_interleaved if vpp > 1 else forward_backward_1f1b
