"""Learning-rate schedules: linear warm-up, then constant, linear, cosine or WSD decay.

The schedule is a pure function of the iteration, so a run stopped and resumed follows exactly
the curve of an uninterrupted run (``decay_iters`` defaults to ``train.iters``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(kw_only=True)
class LRSchedule:
    """Learning rate as a function of the iteration number (1-based: iteration 1 is the first step)."""

    lr: float
    """Peak learning rate, reached at the end of warm-up."""
    min_lr: float
    """Floor reached at ``decay_iters`` and kept afterwards."""
    warmup_iters: int
    """Linear ramp length; iteration k <= warmup uses lr * k / warmup."""
    decay_iters: int
    """Iteration at which decay ends."""
    style: str
    """"constant", "linear", "cosine" or "wsd" (warmup-stable-decay)."""
    wsd_decay_fraction: float = 0.2
    """For WSD: the final fraction of ``decay_iters`` over which lr falls linearly to min_lr."""

    def __post_init__(self) -> None:
        if self.style not in ("constant", "linear", "cosine", "wsd"):
            raise ValueError(f"optim.decay_style={self.style!r} is not one of constant, linear, cosine, wsd")
        if self.decay_iters < self.warmup_iters:
            raise ValueError(
                f"optim.decay_iters={self.decay_iters} is smaller than optim.warmup_iters={self.warmup_iters}"
            )

    def __call__(self, iteration: int) -> float:
        if self.warmup_iters > 0 and iteration <= self.warmup_iters:
            return self.lr * iteration / self.warmup_iters
        if self.style == "constant":
            return self.lr
        if iteration >= self.decay_iters:
            return self.min_lr
        span = self.decay_iters - self.warmup_iters
        progress = (iteration - self.warmup_iters) / span if span > 0 else 1.0
        if self.style == "linear":
            return self.min_lr + (self.lr - self.min_lr) * (1.0 - progress)
        if self.style == "cosine":
            return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))
        # WSD: stable at lr, then a linear cool-down over the last fraction of the decay span.
        decay_start = self.decay_iters - self.wsd_decay_fraction * span
        if iteration <= decay_start:
            return self.lr
        frac = (iteration - decay_start) / (self.decay_iters - decay_start)
        return self.min_lr + (self.lr - self.min_lr) * (1.0 - frac)


def lr_schedule(optim: Any, iters: int) -> LRSchedule:
    """The schedule of the ``optim`` section (``decay_iters`` null: ``iters``, the run's length).

    Raises:
        ValueError: naming the keys (decay ends before warm-up does).
    """
    decay_iters = optim.decay_iters if optim.decay_iters is not None else iters
    try:
        return LRSchedule(lr=optim.lr, min_lr=optim.min_lr, warmup_iters=optim.warmup_iters, decay_iters=decay_iters,
                          style=optim.decay_style, wsd_decay_fraction=optim.wsd_decay_fraction)
    except ValueError as e:
        unset = optim.decay_iters is None
        raise ValueError(f"{e}{' (optim.decay_iters is unset, so it is train.iters)' if unset else ''}") from None
