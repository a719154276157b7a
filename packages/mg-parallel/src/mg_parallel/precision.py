"""The precision policy: the one place a precision name becomes dtypes and a loss scaler.

mg trains with fp32 main parameters (the optimizer's copies, and its Adam moments) and keeps the
model's own parameters, and so its matmuls and activations, in the policy's dtype:

========  ===========  =============  ==================  =================  =====================  ===========
name      param dtype  compute dtype  grad-reduce dtype   main-param dtype   loss scaler            GEMM recipe
========  ===========  =============  ==================  =================  =====================  ===========
``fp32``  float32      float32        float32             float32            none                   plain
``bf16``  bfloat16     bfloat16       float32             float32            none                   plain
``fp16``  float16      float16        float32             float32            dynamic (or constant)  plain
========  ===========  =============  ==================  =================  =====================  ===========

Gradients are accumulated and reduced over data parallelism in fp32 for bf16/fp16: summing many
micro-batches and ranks in 8 (bf16) or 11 (fp16) mantissa bits loses the small updates. fp16 needs
a loss scaler because its range ends at 65504 and small gradients underflow to zero; bf16 has
fp32's range and needs none.

The GEMM recipe (``precision.gemm``, a :class:`~mg_parallel.gemm.Gemm`) is how the layers' matmuls
are computed. Every policy defaults to the plain one (``F.linear``/``torch.mm``/``torch._grouped_mm``
in the compute dtype); a policy with another recipe (fp8 with scaling, say) is
``Precision.from_name("bf16", gemm=MyRecipe())``. The policy does not reach into a model by itself:
whoever builds the model applies it with ``use_gemm(model, precision.gemm)`` (layers take the recipe at
construction too, ``gemm=``); :func:`mg_models.loading.build_model` does so when given a ``precision``.

A policy also carries how fp16's loss scaler is built (``precision.loss_scaling``, a :class:`LossScaling`
with :class:`~mg_parallel.optimizer.OptimizerConfig`'s fields of the same names), so one object made where a
run starts (``OptimizerConfig.precision_policy()``, or ``from_name``) says everything the model, its wrapper
and the optimizer need to know about precision.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mg_parallel.gemm import PLAIN_GEMM, Gemm

if TYPE_CHECKING:
    from mg_parallel.optimizer.loss_scaler import LossScaler

__all__ = ["PRECISION_NAMES", "LossScaling", "Precision"]

PRECISION_NAMES = ("fp32", "bf16", "fp16")
"""The valid precision names, in the order error messages list them."""

_PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class LossScaling:
    """How an fp16 policy's loss scaler is built (ignored by fp32 and bf16, which need none)."""

    loss_scale: float | None = None
    """A constant loss scale; None selects the dynamic scaler."""
    initial_loss_scale: float = 2.0**16
    """Dynamic scaler: starting scale."""
    min_loss_scale: float = 1.0
    """Dynamic scaler: the scale never backs off below this."""
    loss_scale_window: int = 1000
    """Dynamic scaler: clean steps before the scale grows by 2."""
    hysteresis: int = 2
    """Dynamic scaler: overflowing steps tolerated before the scale backs off by 2."""

    def __post_init__(self) -> None:
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ValueError(f"loss_scale must be > 0, or None for the dynamic scaler; got {self.loss_scale}")
        if self.initial_loss_scale <= 0 or self.min_loss_scale <= 0:
            raise ValueError(f"initial_loss_scale and min_loss_scale must be > 0, got {self.initial_loss_scale} "
                             f"and {self.min_loss_scale}")
        if self.loss_scale_window < 1 or self.hysteresis < 1:
            raise ValueError(f"loss_scale_window and hysteresis must be >= 1, got {self.loss_scale_window} and "
                             f"{self.hysteresis}")


@dataclass(frozen=True)
class Precision:
    """A mixed-precision policy; build it with :meth:`from_name`."""

    name: str
    """``"fp32"``, ``"bf16"`` or ``"fp16"``."""
    param_dtype: torch.dtype
    """dtype of the model's parameters (cast the model to it before wrapping it in DDP)."""
    compute_dtype: torch.dtype
    """dtype of the matmuls and activations (the parameters' dtype: mg does not autocast)."""
    grad_reduce_dtype: torch.dtype
    """dtype of DDP's gradient buffers, in which gradients accumulate and are reduced over dp."""
    main_param_dtype: torch.dtype
    """dtype of the optimizer's main parameters and Adam moments."""
    gemm: Gemm = PLAIN_GEMM
    """GEMM recipe of the layers' matmuls (apply it with :func:`mg_parallel.gemm.use_gemm`)."""
    loss_scaling: LossScaling = LossScaling()
    """How :meth:`build_loss_scaler` builds fp16's scaler (the dynamic one from 2**16 by default)."""

    @classmethod
    def from_name(cls, name: str, *, gemm: Gemm = PLAIN_GEMM, loss_scaling: LossScaling | None = None) -> Precision:
        """The policy called ``name``, its matmuls computed by ``gemm`` (default: the plain recipe), fp16's loss
        scaler built as ``loss_scaling`` says (default: dynamic, :class:`LossScaling`'s defaults).

        Raises:
            ValueError: ``name`` is not one of :data:`PRECISION_NAMES` (the message lists them).
        """
        if name not in _PARAM_DTYPES:
            raise ValueError(f"unknown precision {name!r}; choose one of {', '.join(PRECISION_NAMES)}")
        dtype = _PARAM_DTYPES[name]
        return cls(name=name, param_dtype=dtype, compute_dtype=dtype, grad_reduce_dtype=torch.float32,
                   main_param_dtype=torch.float32, gemm=gemm, loss_scaling=loss_scaling or LossScaling())

    @classmethod
    def resolve(cls, precision: Precision | str) -> Precision:
        """``precision`` itself, or the policy of that name (see :meth:`from_name` for errors)."""
        return precision if isinstance(precision, Precision) else cls.from_name(precision)

    @property
    def needs_loss_scaling(self) -> bool:
        """True for fp16, whose gradients underflow without a loss scale."""
        return self.param_dtype == torch.float16

    def build_loss_scaler(self, **overrides: float | int | None) -> LossScaler | None:
        """The loss scaler this policy trains with: as :attr:`loss_scaling` says, with ``overrides`` (fields of
        :class:`LossScaling`, e.g. ``loss_scale=128.0``) replacing its values.

        fp16: a :class:`~mg_parallel.optimizer.ConstantLossScaler` when ``loss_scale`` is set, else a
        :class:`~mg_parallel.optimizer.DynamicLossScaler` from the other fields. fp32 and bf16: None, whatever
        the fields.

        Raises:
            ValueError: a scale, window or hysteresis out of range. TypeError: an override that is no field.
        """
        scaling = dataclasses.replace(self.loss_scaling, **overrides) if overrides else self.loss_scaling
        if not self.needs_loss_scaling:
            return None
        from mg_parallel.optimizer.loss_scaler import ConstantLossScaler, DynamicLossScaler

        if scaling.loss_scale is not None:
            return ConstantLossScaler(scaling.loss_scale)
        return DynamicLossScaler(scaling.initial_loss_scale, min_scale=scaling.min_loss_scale,
                                 growth_interval=scaling.loss_scale_window, hysteresis=scaling.hysteresis)
