"""Data parallelism: gradient buffers and buckets, the DDP wrapper, gradient finalisation."""

from mg_parallel.distributed.buffers import Bucket, GradBuffer
from mg_parallel.distributed.ddp import DistributedDataParallel
from mg_parallel.distributed.finalize import finalize_model_grads, grad_of
from mg_parallel.distributed.fsdp import (
    apply_fsdp,
    check_fsdp,
    clip_fsdp_grads,
    finalize_fsdp_grads,
    fsdp_grad_norm,
    fsdp_mesh,
    local_tensor,
    memory_bytes,
    no_gradient_sync,
)

__all__ = [
    "Bucket", "DistributedDataParallel", "GradBuffer", "apply_fsdp", "check_fsdp", "clip_fsdp_grads",
    "finalize_fsdp_grads", "finalize_model_grads", "fsdp_grad_norm", "fsdp_mesh", "grad_of", "local_tensor",
    "memory_bytes", "no_gradient_sync",
]
