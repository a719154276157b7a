"""Optimizer configuration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mg_parallel.gemm import PLAIN_GEMM, Gemm
from mg_parallel.precision import PRECISION_NAMES, LossScaling, Precision

__all__ = ["OptimizerConfig"]


@dataclass(kw_only=True)
class OptimizerConfig:
    """AdamW, mixed precision, loss scaling, clipping and ZeRO options."""

    lr: float = 1e-4
    """Learning rate (a scheduler may overwrite ``param_groups[i]["lr"]`` every step)."""
    min_lr: float = 0.0
    """Floor for learning-rate schedulers; unused by the optimizer itself."""
    weight_decay: float = 0.01
    """Decoupled (AdamW) weight decay for parameters with ndim >= 2."""
    decay_1d_params: bool = False
    """Also decay 1-D parameters (biases, norm weights); by default they get no weight decay."""
    adam_beta1: float = 0.9
    """Adam first-moment decay."""
    adam_beta2: float = 0.999
    """Adam second-moment decay."""
    adam_eps: float = 1e-8
    """Adam denominator epsilon."""
    clip_grad: float = 1.0
    """Clip gradients to this global L2 norm; 0 disables clipping."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Model parameter dtype: "fp32", "bf16" or "fp16" (a :class:`~mg_parallel.precision.Precision` name);
    main params and Adam state are fp32."""
    use_distributed_optimizer: bool = False
    """Shard fp32 main params and Adam state over the data-parallel group (ZeRO-1/2)."""
    overlap_param_gather: bool = False
    """Distributed optimizer: all-gather updated params asynchronously, waiting per module in the next forward."""
    loss_scale: float | None = None
    """fp16: a constant loss scale; None selects the dynamic scaler."""
    initial_loss_scale: float = 2.0**16
    """fp16 dynamic scaler: starting scale."""
    min_loss_scale: float = 1.0
    """fp16 dynamic scaler: the scale never backs off below this."""
    loss_scale_window: int = 1000
    """fp16 dynamic scaler: clean steps before the scale grows by 2."""
    hysteresis: int = 2
    """fp16 dynamic scaler: overflowing steps tolerated before the scale backs off by 2."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISION_NAMES:
            raise ValueError(f"optimizer.precision must be one of {PRECISION_NAMES}, got {self.precision!r}")
        if self.lr < 0 or self.min_lr < 0:
            raise ValueError(f"optimizer.lr and optimizer.min_lr must be >= 0, got {self.lr}, {self.min_lr}")
        if self.weight_decay < 0:
            raise ValueError(f"optimizer.weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"optimizer.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.adam_eps <= 0:
            raise ValueError(f"optimizer.adam_eps must be > 0, got {self.adam_eps}")
        if self.clip_grad < 0:
            raise ValueError(f"optimizer.clip_grad must be >= 0 (0 disables clipping), got {self.clip_grad}")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ValueError(f"optimizer.loss_scale must be > 0 or None (dynamic), got {self.loss_scale}")
        if self.initial_loss_scale <= 0 or self.min_loss_scale <= 0:
            raise ValueError("optimizer.initial_loss_scale and optimizer.min_loss_scale must be > 0")
        if self.loss_scale_window < 1 or self.hysteresis < 1:
            raise ValueError("optimizer.loss_scale_window and optimizer.hysteresis must be >= 1")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("optimizer.overlap_param_gather needs optimizer.use_distributed_optimizer=true")

    def precision_policy(self, *, gemm: Gemm = PLAIN_GEMM) -> Precision:
        """The :class:`~mg_parallel.precision.Precision` of ``precision`` and the loss-scaling fields, its matmuls
        computed by ``gemm``: make it once where a run starts and pass the object to the model, its wrapper and
        :func:`~mg_parallel.optimizer.build_optimizer`."""
        scaling = LossScaling(loss_scale=self.loss_scale, initial_loss_scale=self.initial_loss_scale,
                              min_loss_scale=self.min_loss_scale, loss_scale_window=self.loss_scale_window,
                              hysteresis=self.hysteresis)
        return Precision.from_name(self.precision, gemm=gemm, loss_scaling=scaling)
