"""One training step and one evaluation, over this rank's model chunks and the pipeline schedule."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from mg_cli.training.run import Run, StepInterval
from mg_cli.training.setup import TrainingError


@dataclass
class StepResult:
    """What one optimizer step did, as every rank agrees on it.

    A step that is not logged reads nothing back from the device: ``loss``, ``parts``, ``grad_norm`` and
    ``seconds`` are filled in only for logged steps (``logged``), the loss staying a device tensor until
    :func:`check_loss` reads it (before anything is saved).
    """

    iteration: int
    lr: float
    applied: bool
    """False when an fp16 overflow skipped the step (on every rank)."""
    logged: bool = True
    loss: float | None = None
    """Mean loss of the global batch (the same at every layout)."""
    parts: dict[str, float] = field(default_factory=dict)
    """The loss's logged parts (BERT: ``lm_loss``, ``sop_loss``; T5: ``lm_loss``)."""
    grad_norm: float | None = None
    seconds: float = 0.0
    """Mean wall time of the steps since the previous logged one, compilation left out."""
    compile_seconds: float = 0.0
    """Time ``torch.compile`` took in those steps (``train.compile``: the first steps, and any recompilation)."""
    pending_loss: Any = None
    """An unlogged step's loss, on the device."""


def train_step(run: Run, iteration: int, batches: Any, *, log: bool = True) -> StepResult:
    """Forward/backward over one global batch's micro-batches from ``batches`` and one optimizer step.

    With ``log=False`` the step leaves the host free of the device: no value is read back (fp16's overflow
    check excepted), gradients are clipped by a factor computed on the device, and its time is added to the
    interval the next logged step reports the mean of.

    Raises:
        TrainingError: a non-finite loss with fp32/bf16 at a logged step (fp16 skips the step instead).
    """
    from mg_parallel.pipeline import average_losses

    optimizer, grid = run.optimizer, run.grid
    lr = run.schedule(iteration)
    for group in optimizer.param_groups:
        group["lr"] = lr
    interval = run.interval
    if interval.steps == 0:
        interval.compile_mark = run.compile_clock.seconds if run.compile_clock is not None else 0.0
    t0 = time.perf_counter()
    optimizer.zero_grad()
    moe = run.moe
    moe.start(optimizer.loss_scale, run.num_micro)
    try:
        losses = run.forward_backward(run.forward_step, batches, run.model, run.num_micro, grid,
                                      tensor_shape=run.tensor_shape, dtype=run.precision.compute_dtype,
                                      scale_loss=optimizer.scale_loss if run.precision.needs_loss_scaling else None)
    finally:
        moe.finish()
    run.saver.wait_for_snapshot()  # a background checkpoint copy must finish before the step mutates the state
    applied, grad_norm = optimizer.step(host_sync=False)
    interval.steps += 1
    if not log:
        interval.seconds += time.perf_counter() - t0
        return StepResult(iteration=iteration, lr=lr, applied=applied, logged=False,
                          pending_loss=average_losses(losses, grid, host_sync=False))
    loss = float(average_losses(losses, grid))
    parts = {k: float(average_losses(losses, grid, key=k)) for k in run.logged_losses}
    parts.update(moe.metrics())
    if grid.device.type == "cuda":
        torch.cuda.synchronize()
    interval.seconds += time.perf_counter() - t0
    compiled = run.compile_clock.seconds - interval.compile_mark if run.compile_clock is not None else 0.0
    seconds = max(interval.seconds - compiled, 1e-9) / interval.steps
    run.interval = StepInterval()
    result = StepResult(iteration=iteration, lr=lr, applied=applied, loss=loss, parts=parts,
                        grad_norm=float(grad_norm) if grad_norm is not None else None, seconds=seconds,
                        compile_seconds=compiled)
    check_loss(run, result)
    return result


def check_loss(run: Run, result: StepResult) -> None:
    """Raise if the step's loss is not finite (fp32/bf16; fp16 skips such steps): at every logged step, and before
    anything is saved after an unlogged one (reading its loss back).

    Raises:
        TrainingError: naming the iteration and the precision.
    """
    loss = result.loss if result.loss is not None else float(result.pending_loss)
    if not math.isfinite(loss) and not run.precision.needs_loss_scaling:
        raise TrainingError(
            f"loss is {loss} at iteration {result.iteration} ({run.precision.name}); lower optim.lr or check "
            f"the data. Nothing was saved for this iteration"
        )


def evaluate(run: Run, batches: list[Any]) -> dict[str, float]:
    """Mean validation loss over ``batches`` (global batches' micro-batches), its parts and the LM perplexity.

    Returns ``{"val_loss", "val_<part>"..., "val_ppl"}``; the perplexity is of the language-model part
    (BERT: the masked tokens, without the sentence-order loss), and absent for classification.
    """
    from mg_parallel.pipeline import average_losses

    for chunk in run.model:
        chunk.eval()
    with torch.no_grad():
        losses = run.forward_backward(run.forward_step, iter(batches), run.model, len(batches), run.grid,
                                      tensor_shape=run.tensor_shape, dtype=run.precision.compute_dtype,
                                      forward_only=True)
    for chunk in run.model:
        chunk.train()
        if getattr(chunk, "fully_sharded", False):
            chunk.reshard()  # units kept gathered for a backward that a forward-only pass does not run
    val = float(average_losses(losses, run.grid))
    parts = {f"val_{k}": float(average_losses(losses, run.grid, key=k)) for k in run.logged_losses}
    if run.config.data.format == "classification":  # a loss over labels: no perplexity
        return {"val_loss": val, **parts}
    lm = parts.get("val_lm_loss", val)
    return {"val_loss": val, **parts, "val_ppl": math.exp(min(lm, 50.0))}
