"""This process's place in a job (rank, world size, from torchrun's or Slurm's variables) and joining the job's
default process group: what training and evaluation both start with."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

__all__ = ["Env", "JobEnvError", "init_distributed", "read_env"]


class JobEnvError(RuntimeError):
    """The launcher's environment is unusable (one line naming the variable)."""


@dataclass
class Env:
    """This process's place in the job, from the launcher's environment."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def read_env() -> Env:
    """Rank and world size from torchrun's/Slurm's variables (a single process without them)."""
    def num(name: str, default: int) -> int:
        value = os.environ.get(name)
        if value is None:
            return default
        try:
            return int(value)
        except ValueError:
            raise JobEnvError(f"environment variable {name}={value!r} is not an integer") from None

    world = num("WORLD_SIZE", 1)
    return Env(rank=num("RANK", 0), world_size=world, local_rank=num("LOCAL_RANK", 0),
               local_world_size=num("LOCAL_WORLD_SIZE", world))


def init_distributed(env: Env, timeout_s: float = 600.0) -> None:
    """Join the job's default process group (NCCL on CUDA, gloo on CPU).

    A collective that waits longer than ``timeout_s`` fails instead of hanging, so a dead rank
    ends the job.
    """
    import torch
    import torch.distributed as dist

    if env.world_size <= 1 or dist.is_initialized():
        return
    from mg_parallel.device import default_backend, local_device

    backend = default_backend()
    if backend == "nccl":
        torch.cuda.set_device(local_device())
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
