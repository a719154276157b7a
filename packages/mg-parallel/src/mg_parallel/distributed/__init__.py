"""Data parallelism: gradient buffers and buckets, the DDP wrapper, gradient finalisation."""

from mg_parallel.distributed.buffers import Bucket, GradBuffer
from mg_parallel.distributed.ddp import DistributedDataParallel
from mg_parallel.distributed.finalize import finalize_model_grads, grad_of

__all__ = ["Bucket", "DistributedDataParallel", "GradBuffer", "finalize_model_grads", "grad_of"]
