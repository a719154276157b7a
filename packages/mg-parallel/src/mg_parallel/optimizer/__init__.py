"""AdamW with fp32 main params, ZeRO sharding, loss scaling and global-norm clipping."""

from mg_parallel.optimizer.adamw import adamw_update, fused_adamw_supported
from mg_parallel.optimizer.clip import clip_grads, counts_in_norm, global_grad_norm
from mg_parallel.optimizer.config import OptimizerConfig
from mg_parallel.optimizer.loss_scaler import ConstantLossScaler, DynamicLossScaler, LossScaler
from mg_parallel.optimizer.optimizer import MegatronStyleOptimizer, build_optimizer

__all__ = [
    "ConstantLossScaler",
    "DynamicLossScaler",
    "LossScaler",
    "MegatronStyleOptimizer",
    "OptimizerConfig",
    "adamw_update",
    "build_optimizer",
    "clip_grads",
    "counts_in_norm",
    "fused_adamw_supported",
    "global_grad_norm",
]
