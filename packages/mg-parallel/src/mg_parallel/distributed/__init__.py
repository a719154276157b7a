"""Data parallelism: gradient buffers and buckets, the DDP wrapper, gradient finalisation, and FSDP2.

The FSDP helpers (:mod:`mg_parallel.distributed.fsdp`) are imported on first use: they pull in
torch's DTensor stack, which DDP-only training does not need.
"""

from typing import Any

from mg_parallel.distributed.buffers import Bucket, GradBuffer
from mg_parallel.distributed.ddp import DistributedDataParallel
from mg_parallel.distributed.finalize import finalize_model_grads, grad_of

_FSDP_NAMES = (
    "FullyShardedChunk", "apply_fsdp", "check_fsdp", "clip_fsdp_grads", "finalize_fsdp_grads", "fsdp_grad_norm",
    "fsdp_mesh", "local_flat_range", "local_tensor", "memory_bytes", "no_gradient_sync", "replicas",
)

__all__ = ["Bucket", "DistributedDataParallel", "GradBuffer", "finalize_model_grads", "grad_of", *_FSDP_NAMES]


def __getattr__(name: str) -> Any:
    if name in _FSDP_NAMES:
        from mg_parallel.distributed import fsdp

        return getattr(fsdp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
