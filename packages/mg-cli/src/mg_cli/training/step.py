"""One training step and one evaluation, over this rank's model chunks and the pipeline schedule."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from mg_cli.training.run import Run
from mg_cli.training.setup import TrainingError


@dataclass
class StepResult:
    """What one optimizer step did, as every rank agrees on it."""

    iteration: int
    loss: float
    """Mean loss of the global batch (the same at every layout)."""
    parts: dict[str, float]
    """The loss's logged parts (BERT: ``lm_loss``, ``sop_loss``; T5: ``lm_loss``)."""
    lr: float
    applied: bool
    """False when an fp16 overflow skipped the step (on every rank)."""
    grad_norm: float | None
    seconds: float


def train_step(run: Run, iteration: int, batches: Any) -> StepResult:
    """Forward/backward over one global batch's micro-batches from ``batches`` and one optimizer step.

    Raises:
        TrainingError: a non-finite loss with fp32/bf16 (fp16 skips the step instead).
    """
    from mg_parallel.pipeline import average_losses

    optimizer, grid = run.optimizer, run.grid
    lr = run.schedule(iteration)
    for group in optimizer.param_groups:
        group["lr"] = lr
    t0 = time.perf_counter()
    optimizer.zero_grad()
    moe = run.moe
    moe.start(optimizer.loss_scale, run.num_micro)
    try:
        losses = run.forward_backward(run.forward_step, batches, run.model, run.num_micro, grid,
                                      tensor_shape=run.tensor_shape, dtype=run.dtype,
                                      scale_loss=optimizer.scale_loss if run.fp16 else None)
    finally:
        moe.finish()
    run.saver.wait_for_snapshot()  # a background checkpoint copy must finish before the step mutates the state
    applied, grad_norm = optimizer.step()
    loss = float(average_losses(losses, grid))
    parts = {k: float(average_losses(losses, grid, key=k)) for k in run.logged_losses}
    parts.update(moe.metrics())
    if grid.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if not math.isfinite(loss) and not run.fp16:
        raise TrainingError(
            f"loss is {loss} at iteration {iteration} ({run.config.train.precision}); lower optim.lr or check the "
            f"data. Nothing was saved for this iteration"
        )
    return StepResult(iteration=iteration, loss=loss, parts=parts, lr=lr, applied=applied,
                      grad_norm=float(grad_norm) if grad_norm is not None else None, seconds=seconds)


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
                                      tensor_shape=run.tensor_shape, dtype=run.dtype, forward_only=True)
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
