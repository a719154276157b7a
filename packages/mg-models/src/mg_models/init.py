"""Layout-independent parameter initialisation.

Every parameter's values are a function of ``(seed, global parameter name)`` only: the full
(master) tensor is drawn on the CPU from a generator seeded by a hash of both, and a
tensor-parallel layer keeps its shard. So a tp=2/pp=2 model equals the tp=1 model for the same
seed, and a pipeline stage equals the matching layers of the whole model.
"""

from __future__ import annotations

import hashlib
import math

import torch

from mg_parallel.tensor_parallel import InitMethod

__all__ = ["InitMethod", "name_seed", "normal_init", "scaled_std"]


def name_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed derived from the model seed and a global parameter name."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def normal_init(seed: int, name: str, std: float) -> InitMethod:
    """An init method filling a tensor with N(0, std^2) drawn from a generator seeded by ``(seed, name)``.

    The values are drawn in fp32 on the CPU and copied, so they do not depend on the tensor's
    device or dtype.
    """

    def init(tensor: torch.Tensor) -> None:
        gen = torch.Generator(device="cpu").manual_seed(name_seed(seed, name))
        values = torch.empty(tensor.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
        with torch.no_grad():
            tensor.copy_(values)

    return init


def scaled_std(std: float, num_layers: int) -> float:
    """GPT-2/Megatron init std for projections into the residual stream: std / sqrt(2 * num_layers)."""
    return std / math.sqrt(2.0 * num_layers)
