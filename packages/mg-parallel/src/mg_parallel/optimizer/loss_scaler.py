"""Loss scaling for fp16 training: constant, or dynamic with growth, backoff and hysteresis."""

from __future__ import annotations

from typing import Any

__all__ = ["ConstantLossScaler", "DynamicLossScaler", "LossScaler"]


class LossScaler:
    """Base class: ``scale`` multiplies the loss; ``update(found_inf)`` runs after every step."""

    scale: float

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step whose gradients did (or did not) overflow."""

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state for checkpoints."""
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.scale = float(state["scale"])


class ConstantLossScaler(LossScaler):
    """A fixed loss scale (overflowing steps are still skipped)."""

    def __init__(self, scale: float) -> None:
        if scale <= 0:
            raise ValueError(f"loss_scale must be > 0, got {scale}")
        self.scale = float(scale)


class DynamicLossScaler(LossScaler):
    """Megatron-style dynamic loss scale.

    After ``hysteresis`` overflowing steps (not necessarily consecutive) the scale is multiplied
    by ``backoff_factor`` (never below ``min_scale``); after ``growth_interval`` consecutive
    clean steps it is multiplied by ``growth_factor`` and the hysteresis budget is refilled.

    Raises:
        ValueError: a factor or interval out of range.
    """

    def __init__(
        self,
        initial_scale: float = 2.0**16,
        *,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
    ) -> None:
        if initial_scale <= 0 or min_scale <= 0:
            raise ValueError("initial_loss_scale and min_loss_scale must be > 0")
        if growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise ValueError("loss-scale growth_factor must be > 1 and backoff_factor in (0, 1)")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError("loss_scale_window and hysteresis must be >= 1")
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        """Back off after ``hysteresis`` overflows; grow after ``growth_interval`` clean steps."""
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        """Scale and trackers."""
        return {"scale": self.scale, "growth_tracker": self._growth_tracker, "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.scale = float(state["scale"])
        self._growth_tracker = int(state.get("growth_tracker", 0))
        self._hysteresis_tracker = int(state.get("hysteresis_tracker", self.hysteresis))
