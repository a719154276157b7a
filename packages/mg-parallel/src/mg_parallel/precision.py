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
construction too, ``gemm=``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mg_parallel.gemm import PLAIN_GEMM, Gemm

if TYPE_CHECKING:
    from mg_parallel.optimizer.loss_scaler import LossScaler

__all__ = ["PRECISION_NAMES", "Precision"]

PRECISION_NAMES = ("fp32", "bf16", "fp16")
"""The valid precision names, in the order error messages list them."""

_PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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

    @classmethod
    def from_name(cls, name: str, *, gemm: Gemm = PLAIN_GEMM) -> Precision:
        """The policy called ``name``, its matmuls computed by ``gemm`` (default: the plain recipe).

        Raises:
            ValueError: ``name`` is not one of :data:`PRECISION_NAMES` (the message lists them).
        """
        if name not in _PARAM_DTYPES:
            raise ValueError(f"unknown precision {name!r}; choose one of {', '.join(PRECISION_NAMES)}")
        dtype = _PARAM_DTYPES[name]
        return cls(name=name, param_dtype=dtype, compute_dtype=dtype, grad_reduce_dtype=torch.float32,
                   main_param_dtype=torch.float32, gemm=gemm)

    @classmethod
    def resolve(cls, precision: Precision | str) -> Precision:
        """``precision`` itself, or the policy of that name (see :meth:`from_name` for errors)."""
        return precision if isinstance(precision, Precision) else cls.from_name(precision)

    @property
    def needs_loss_scaling(self) -> bool:
        """True for fp16, whose gradients underflow without a loss scale."""
        return self.param_dtype == torch.float16

    def build_loss_scaler(
        self,
        *,
        loss_scale: float | None = None,
        initial_loss_scale: float = 2.0**16,
        min_loss_scale: float = 1.0,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
    ) -> LossScaler | None:
        """The loss scaler this policy trains with.

        fp16: a :class:`~mg_parallel.optimizer.ConstantLossScaler` when ``loss_scale`` is given,
        else a :class:`~mg_parallel.optimizer.DynamicLossScaler` from the other arguments (the
        :class:`~mg_parallel.optimizer.OptimizerConfig` fields of the same names). fp32 and bf16:
        None, whatever the arguments.

        Raises:
            ValueError: a scale, window or hysteresis out of range (from the scaler).
        """
        if not self.needs_loss_scaling:
            return None
        from mg_parallel.optimizer.loss_scaler import ConstantLossScaler, DynamicLossScaler

        if loss_scale is not None:
            return ConstantLossScaler(loss_scale)
        return DynamicLossScaler(initial_loss_scale, min_scale=min_loss_scale, growth_interval=loss_scale_window,
                                 hysteresis=hysteresis)
