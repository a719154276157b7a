"""Device and backend selection from the process environment.

Nothing in mg hard-codes CUDA or CPU: a process uses ``cuda:$LOCAL_RANK`` with NCCL when CUDA
is available and the CPU with gloo otherwise.
"""

from __future__ import annotations

import os

import torch


def cuda_usable() -> bool:
    """True when this process should run on CUDA (a GPU is visible and not disabled)."""
    return torch.cuda.is_available() and os.environ.get("MG_FORCE_CPU", "0") != "1"


def default_backend() -> str:
    """The ``torch.distributed`` backend for this machine: ``"nccl"`` on CUDA, else ``"gloo"``."""
    return "nccl" if cuda_usable() else "gloo"


def local_rank() -> int:
    """This process's rank on its node, from ``LOCAL_RANK`` (set by torchrun/Slurm), default 0."""
    value = os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    try:
        return int(value)
    except ValueError as e:
        raise ValueError(f"LOCAL_RANK={value!r} is not an integer; unset it or set it to this process's local rank") from e


def local_device() -> torch.device:
    """The device this process computes on: ``cuda:LOCAL_RANK`` when CUDA is usable, else CPU.

    Raises:
        ValueError: ``LOCAL_RANK`` is not below the number of visible GPUs (two ranks would share
            one GPU: start at most one process per GPU).
    """
    if cuda_usable():
        rank, count = local_rank(), torch.cuda.device_count()
        if rank >= count:
            raise ValueError(
                f"LOCAL_RANK={rank} but this node has {count} visible GPU(s), so two ranks would share one; start "
                f"at most {count} processes per node (torchrun --nproc-per-node {count}) or set MG_FORCE_CPU=1"
            )
        return torch.device("cuda", rank)
    return torch.device("cpu")
