"""The device mesh FSDP shards over, from mg's own process groups, and the checks of an FSDP layout.

Full sharding runs on the grid's data-parallel group (``dp_cp_group`` when cp > 1) as a 1-D mesh; hybrid
sharding (HSDP) cuts that group into shard groups of ``shard_size`` consecutive ranks and replicate groups
of ranks ``shard_size`` apart, as a 2-D ``(replicate, shard)`` mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mg_parallel.grid import ProcessGrid

__all__ = ["FSDPConfig", "check_fsdp", "data_parallel_rank_lists", "fsdp_mesh"]


@dataclass(kw_only=True)
class FSDPConfig:
    """Fully sharded data parallelism (ZeRO-3 with PyTorch's FSDP2): whether, over how many ranks, and offload."""

    fsdp: bool = False
    """Shard parameters, gradients and optimizer state over the data-parallel ranks (dp x cp), layer by layer."""
    fsdp_shard_size: int | None = None
    """Hybrid sharding (HSDP): shard within groups of this many data-parallel ranks, replicate across them;
    null shards over all of them."""
    offload_optimizer: bool = False
    """Keep the sharded parameters, gradients and optimizer state in host memory and run the update on the CPU
    (needs fsdp)."""

    def __post_init__(self) -> None:
        if not self.fsdp and (self.fsdp_shard_size is not None or self.offload_optimizer):
            key = "fsdp_shard_size" if self.fsdp_shard_size is not None else "offload_optimizer"
            raise ValueError(f"parallel.{key} needs parallel.fsdp: true (it configures the fully sharded "
                             f"parameters); set fsdp: true or remove {key}")


def check_fsdp(
    grid_or_dp: ProcessGrid | int,
    *,
    fsdp: bool = True,
    use_distributed_optimizer: bool = False,
    shard_size: int | None = None,
    cp: int = 1,
) -> None:
    """Validate an FSDP configuration before any model is built (the CLI calls it on every rank).

    Args:
        grid_or_dp: the process grid, or the data-parallel size.
        fsdp: ``parallel.fsdp``; nothing is checked when False.
        use_distributed_optimizer: ``parallel.use_distributed_optimizer``: mg's ZeRO optimizer, which
            shards state over the same ranks and cannot be combined with FSDP.
        shard_size: ``parallel.fsdp_shard_size`` (HSDP group size) or None for full sharding.
        cp: the context-parallel size (taken from the grid when one is given).

    Raises:
        ValueError: FSDP with the distributed optimizer, or a shard size that is not a positive
            divisor of dp * cp (the message names the keys and the fix).
    """
    if not fsdp:
        return
    if isinstance(grid_or_dp, ProcessGrid):
        dp, cp = grid_or_dp.dp_size, grid_or_dp.cp_size
    else:
        dp = grid_or_dp
    if use_distributed_optimizer:
        raise ValueError(
            "parallel.fsdp and parallel.use_distributed_optimizer cannot both be true: FSDP already shards "
            "parameters, gradients and optimizer state over the data-parallel ranks; set "
            "use_distributed_optimizer: false (and use a torch optimizer over the sharded parameters)"
        )
    if shard_size is not None:
        ranks = dp * cp
        what = f"dp*cp = {dp}*{cp}" if cp > 1 else f"parallel.dp = {dp}"
        if not isinstance(shard_size, int) or shard_size < 1 or ranks % shard_size != 0:
            divisors = [d for d in range(1, ranks + 1) if ranks % d == 0]
            raise ValueError(
                f"parallel.fsdp_shard_size={shard_size!r} must be a positive divisor of {what} (the data-parallel "
                f"ranks it groups); choose one of {divisors}, or leave it unset to shard over all {ranks}"
            )


def data_parallel_rank_lists(grid: ProcessGrid) -> list[list[int]]:
    """Every group of ranks that FSDP shards over (dp, or dp x cp when cp > 1), each sorted, in rank order.

    The same list on every rank, so sub-groups made from it are created in the same order everywhere.
    """
    d = grid.dims
    assert d.dp is not None
    lists = {
        tuple(sorted(d.rank_of(tp=t, pp=p, dp=i, cp=c) for i in range(d.dp) for c in range(d.cp)))
        for t in range(d.tp) for p in range(d.pp)
    }
    return [list(r) for r in sorted(lists)]


def fsdp_mesh(grid: ProcessGrid, shard_size: int | None = None) -> DeviceMesh:
    """The ``DeviceMesh`` FSDP shards over, built from mg's own process groups.

    Full sharding: a 1-D mesh ``("dp_shard",)`` on ``grid.dp_group`` (``grid.dp_cp_group`` when
    cp > 1). HSDP (``shard_size=N``): a 2-D mesh ``("dp_replicate", "dp_shard")`` of shape
    ``(dp*cp/N, N)``: consecutive runs of N data-parallel ranks shard, ranks N apart replicate. The
    HSDP sub-groups are created here with ``dist.new_group``, collectively on every rank in the
    same order, so every rank must call this (and :func:`apply_fsdp`) the same number of times.

    Raises:
        ValueError: ``torch.distributed`` is not initialised, or ``shard_size`` does not divide dp*cp.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "FSDP needs torch.distributed initialised, even for one process; launch with torchrun "
            "(torchrun --nproc-per-node 1 for a single rank)"
        )
    check_fsdp(grid, shard_size=shard_size)
    device_type = grid.device.type
    group = grid.dp_cp_group if grid.cp_size > 1 else grid.dp_group
    assert group is not None
    ranks = grid.dp_size * grid.cp_size
    if shard_size is None or shard_size == ranks:
        return DeviceMesh.from_group(group, device_type, mesh_dim_names=("dp_shard",))
    lists = data_parallel_rank_lists(grid)
    mine = next(r for r in lists if grid.rank in r)
    shard_group = replicate_group = None
    # new_group is collective over the default group: every rank creates every sub-group, in order.
    for ranks_list in lists:
        for i in range(0, len(ranks_list), shard_size):
            g = dist.new_group(ranks_list[i : i + shard_size])
            if grid.rank in ranks_list[i : i + shard_size]:
                shard_group = g
    for ranks_list in lists:
        for j in range(shard_size):
            g = dist.new_group(ranks_list[j::shard_size])
            if grid.rank in ranks_list[j::shard_size]:
                replicate_group = g
    layout = torch.tensor(mine, dtype=torch.int).view(-1, shard_size)  # (replicate, shard)
    return DeviceMesh.from_group(
        [replicate_group, shard_group], device_type, layout, mesh_dim_names=("dp_replicate", "dp_shard")
    )
