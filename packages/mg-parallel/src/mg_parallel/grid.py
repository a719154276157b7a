"""The process grid: parallel dimensions, rank coordinates and process groups.

Ranks are laid out with tensor parallelism varying fastest, then context parallelism, then data
parallelism, then pipeline parallelism (Megatron's default ``tp-cp-ep-dp-pp`` order)::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

i.e. ``torch.arange(world_size).view(pp, dp, cp, tp)``. Tensor-parallel peers are therefore
adjacent ranks (on one node when tp <= GPUs per node), which is where the bandwidth is needed.

**Experts.** The expert-parallel (ep) group is carved out of the dp x cp ranks of one tp rank
and pipeline stage: experts replace replication. Numbering those ranks ``j = cp_rank + cp *
dp_rank``, a rank's ``ep_rank`` is ``j % ep`` and its expert-data-parallel index is ``j // ep``,
so ep peers are the nearest ranks after tp (``view(pp, dp*cp // ep, ep, tp)``). Ranks with the same
ep rank hold the same experts and form the expert-data-parallel group (``dp*cp/ep`` ranks): expert
gradients are averaged, and expert optimizer state would be sharded, over it.

``build_grid(ParallelDims(...))`` creates every process group once, on every rank in the same
order, and returns a :class:`ProcessGrid` that layers, wrappers and schedules receive explicitly.
There are no module-level group globals. ``ProcessGrid.single()`` is the trivial grid for one
process without ``torch.distributed``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from mg_parallel.device import local_device

__all__ = ["ParallelDims", "ProcessGrid", "build_grid"]


@dataclass(kw_only=True)
class ParallelDims:
    """The parallel layout: sizes of the parallel dimensions (their product is the world size), the
    virtual pipeline stages per pipeline rank, and whether activations are sequence-parallel."""

    tp: int = 1
    """Tensor-parallel size: each layer's weights are split over this many ranks."""
    pp: int = 1
    """Pipeline-parallel size: the layer stack is split into this many stages."""
    cp: int = 1
    """Context-parallel size: the sequence is split over this many ranks."""
    cp_comm: Literal["p2p", "allgather", "a2a"] = "p2p"
    """How context-parallel attention communicates: p2p (ring), allgather (K/V gathered) or a2a (Ulysses)."""
    dp: int | None = None
    """Data-parallel size; ``None`` derives it as ``world_size // (tp * pp * cp)``."""
    world_size: int | None = None
    """Total number of ranks; ``None`` reads it from ``torch.distributed`` when the grid is built."""
    vpp: int = 1
    """Virtual pipeline stages (model chunks) per pipeline rank; > 1 selects the interleaved schedule."""
    sequence_parallel: bool = False
    """Shard activations along the sequence between tensor-parallel regions (needs tp > 1)."""
    ep: int = 1
    """Expert-parallel size: the experts of an MoE layer are split over this many of the dp x cp ranks."""
    etp: int = 1
    """Expert tensor-parallel size: 1 (each expert whole on its rank) or tp (its FFN split over the tp group)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "vpp", "ep", "etp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel.{name} must be a positive integer, got {value!r}")
        # Imported here: mg_parallel.context_parallel imports the mg_parallel package, which imports this module.
        from mg_parallel.context_parallel.attention import check_cp_comm

        check_cp_comm(self.cp_comm)
        if self.dp is not None and (not isinstance(self.dp, int) or self.dp < 1):
            raise ValueError(f"parallel.dp must be a positive integer or None (derived), got {self.dp!r}")
        if self.vpp > 1 and self.pp == 1:
            raise ValueError("parallel.vpp > 1 needs parallel.pp > 1; set vpp: 1 or raise pp")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel needs parallel.tp > 1; set it to false or raise tp")
        if self.etp not in (1, self.tp):
            raise ValueError(
                f"parallel.etp={self.etp} must be 1 or equal parallel.tp={self.tp}; "
                f"set etp: 1 (whole experts) or etp: {self.tp}"
            )
        if self.world_size is not None:
            self.resolve(self.world_size)

    @property
    def model_parallel_size(self) -> int:
        """tp * pp * cp: ranks that together hold one replica of the model."""
        return self.tp * self.pp * self.cp

    def resolve(self, world_size: int) -> ParallelDims:
        """Fill in ``dp`` and ``world_size`` for ``world_size`` ranks, checking divisibility.

        Raises:
            ValueError: the world size is not divisible by tp*pp*cp, or an explicit dp disagrees.
        """
        mp = self.model_parallel_size
        if world_size % mp != 0:
            keys = "parallel.tp*parallel.pp" + ("*parallel.cp" if self.cp > 1 else "")
            sizes = f"{self.tp}*{self.pp}" + (f"*{self.cp}" if self.cp > 1 else "")
            raise ValueError(
                f"world size {world_size} is not divisible by tp*pp*cp = {mp}: {world_size} processes are not "
                f"divisible by {keys} = {sizes} = {mp}; launch a multiple of {mp} processes or change them"
            )
        dp = world_size // mp
        if self.dp is not None and self.dp != dp:
            raise ValueError(
                f"parallel.dp={self.dp} but world size {world_size} / (tp*pp*cp={mp}) = {dp}; "
                f"leave dp unset to derive it, or launch {self.dp * mp} processes"
            )
        if (dp * self.cp) % self.ep != 0:
            raise ValueError(
                f"parallel.ep={self.ep} does not divide dp*cp = {dp}*{self.cp} = {dp * self.cp} (the ranks the experts "
                f"are spread over); choose an ep that divides {dp * self.cp}, or launch more data-parallel ranks"
            )
        self.dp = dp
        self.world_size = world_size
        return self

    @property
    def expert_dp(self) -> int:
        """dp*cp/ep: ranks holding the same experts (the expert-data-parallel size)."""
        assert self.dp is not None, "call resolve(world_size) first"
        return self.dp * self.cp // self.ep

    def expert_coords(self, rank: int) -> dict[str, int]:
        """The expert-parallel rank and expert-data-parallel index of a global rank."""
        c = self.coords(rank)
        j = c["cp"] + self.cp * c["dp"]
        return {"ep": j % self.ep, "expert_dp": j // self.ep}

    def expert_groups(self) -> tuple[list[list[int]], list[list[int]]]:
        """``(ep_groups, expert_dp_groups)``: all rank lists of each kind, in rank order."""
        assert self.dp is not None, "call resolve(world_size) first"
        ep_groups, edp_groups = [], []
        for pp, tp in itertools.product(range(self.pp), range(self.tp)):
            # dp x cp ranks of this (tp, pp), numbered j = cp + cp * dp.
            ranks = [self.rank_of(tp=tp, pp=pp, cp=j % self.cp, dp=j // self.cp) for j in range(self.dp * self.cp)]
            ep_groups += [ranks[i : i + self.ep] for i in range(0, len(ranks), self.ep)]
            edp_groups += [ranks[i :: self.ep] for i in range(self.ep)]
        return sorted(ep_groups), sorted(edp_groups)

    def check_divides(self, dim: str, value: int, what: str) -> None:
        """Raise ``ValueError`` unless the size of ``dim`` divides ``value`` (``what`` names it).

        Example: ``dims.check_divides("tp", num_attention_heads, "model.num_attention_heads")``.
        """
        size = getattr(self, dim)
        if value % size != 0:
            raise ValueError(
                f"{what}={value} is not divisible by parallel.{dim}={size}; "
                f"choose a {dim} that divides {value} or change {what}"
            )

    def coords(self, rank: int) -> dict[str, int]:
        """The (tp, cp, dp, pp) coordinates of a global rank."""
        assert self.dp is not None, "call resolve(world_size) first"
        tp_rank = rank % self.tp
        cp_rank = (rank // self.tp) % self.cp
        dp_rank = (rank // (self.tp * self.cp)) % self.dp
        pp_rank = rank // (self.tp * self.cp * self.dp)
        return {"tp": tp_rank, "cp": cp_rank, "dp": dp_rank, "pp": pp_rank}

    def rank_of(self, *, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """The global rank at the given coordinates."""
        assert self.dp is not None, "call resolve(world_size) first"
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def groups_along(self, dim: str) -> list[list[int]]:
        """All rank lists that vary only along ``dim`` ("tp", "cp", "dp" or "pp"), in rank order."""
        assert self.dp is not None, "call resolve(world_size) first"
        sizes = {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}
        others = [d for d in ("tp", "cp", "dp", "pp") if d != dim]
        out = []
        for fixed in itertools.product(*(range(sizes[d]) for d in others)):
            at = dict(zip(others, fixed))
            out.append([self.rank_of(**{**at, dim: i}) for i in range(sizes[dim])])
        return sorted(out)


@dataclass
class ProcessGrid:
    """This rank's place in the grid and the process groups it belongs to.

    A group is ``None`` when ``torch.distributed`` is not initialised (the single-process grid);
    code must then treat that dimension as size 1.
    """

    dims: ParallelDims
    rank: int
    world_size: int
    tp_rank: int
    cp_rank: int
    dp_rank: int
    pp_rank: int
    tp_group: dist.ProcessGroup | None = None
    cp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    dp_cp_group: dist.ProcessGroup | None = None
    """Data and context parallel ranks together: gradients are averaged over this group."""
    model_parallel_group: dist.ProcessGroup | None = None
    """tp x pp (x cp) ranks of one model replica: used for global norms and skip decisions."""
    embedding_group: dist.ProcessGroup | None = None
    """First and last pipeline stage of this pipeline (tied embeddings); None when pp == 1."""
    pp_ranks: list[int] = field(default_factory=list)
    """Global ranks of this rank's pipeline, stage 0 first."""
    tp_ranks: list[int] = field(default_factory=list)
    dp_ranks: list[int] = field(default_factory=list)
    ep_rank: int = 0
    """This rank's place in its expert-parallel group (which experts it holds)."""
    ep_group: dist.ProcessGroup | None = None
    """The ep ranks, carved out of dp x cp, over which an MoE layer's experts are split."""
    expert_dp_group: dist.ProcessGroup | None = None
    """The dp*cp/ep ranks holding the same experts: expert gradients are averaged over it."""
    ep_ranks: list[int] = field(default_factory=list)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @classmethod
    def single(cls, device: torch.device | None = None) -> ProcessGrid:
        """The grid of one process, usable without ``torch.distributed``."""
        dims = ParallelDims(tp=1, pp=1, cp=1, dp=1, world_size=1)
        return cls(
            dims=dims, rank=0, world_size=1, tp_rank=0, cp_rank=0, dp_rank=0, pp_rank=0,
            pp_ranks=[0], tp_ranks=[0], dp_ranks=[0], ep_ranks=[0], device=device or local_device(),
        )

    @property
    def tp_size(self) -> int:
        return self.dims.tp

    @property
    def pp_size(self) -> int:
        return self.dims.pp

    @property
    def cp_size(self) -> int:
        return self.dims.cp

    @property
    def dp_size(self) -> int:
        assert self.dims.dp is not None
        return self.dims.dp

    @property
    def ep_size(self) -> int:
        return self.dims.ep

    @property
    def etp_size(self) -> int:
        return self.dims.etp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.dims.pp - 1

    @property
    def prev_stage_rank(self) -> int | None:
        """Global rank of the previous pipeline stage, or None on the first stage."""
        return None if self.is_first_stage else self.pp_ranks[self.pp_rank - 1]

    @property
    def next_stage_rank(self) -> int | None:
        """Global rank of the next pipeline stage, or None on the last stage."""
        return None if self.is_last_stage else self.pp_ranks[self.pp_rank + 1]

    def coords(self) -> dict[str, int]:
        """This rank's coordinates ``{"tp", "cp", "dp", "pp"}``."""
        return {"tp": self.tp_rank, "cp": self.cp_rank, "dp": self.dp_rank, "pp": self.pp_rank}

    def __repr__(self) -> str:
        d = self.dims
        return (
            f"ProcessGrid(rank={self.rank}/{self.world_size}, tp={self.tp_rank}/{d.tp}, cp={self.cp_rank}/{d.cp}, "
            f"dp={self.dp_rank}/{d.dp}, pp={self.pp_rank}/{d.pp}, device={self.device})"
        )


def build_grid(dims: ParallelDims, device: torch.device | None = None) -> ProcessGrid:
    """Create every process group for ``dims`` and return this rank's :class:`ProcessGrid`.

    Must be called on every rank (it is collective). When ``torch.distributed`` is not
    initialised, only a world of one is allowed and the single-process grid is returned.

    Raises:
        ValueError: the dimensions do not fit the world size (raised on every rank before any
            collective runs, since every rank validates the same numbers).
    """
    if not dist.is_available() or not dist.is_initialized():
        if dims.model_parallel_size != 1 or (dims.dp or 1) != 1:
            n = dims.model_parallel_size * (dims.dp or 1)
            raise ValueError(
                f"this layout needs {n} processes, but torch.distributed is not initialised; "
                f"launch with torchrun --nproc-per-node {n}"
            )
        dims.resolve(1)
        return ProcessGrid.single(device)
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    dims.resolve(world_size)
    c = dims.coords(rank)
    grid = ProcessGrid(
        dims=dims, rank=rank, world_size=world_size,
        tp_rank=c["tp"], cp_rank=c["cp"], dp_rank=c["dp"], pp_rank=c["pp"],
        device=device or local_device(),
    )

    def make(rank_lists: list[list[int]]) -> tuple[dist.ProcessGroup | None, list[int]]:
        # new_group is collective over the default group: every rank creates every group.
        mine, my_ranks = None, []
        for ranks in rank_lists:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine, my_ranks = group, ranks
        return mine, my_ranks

    grid.tp_group, grid.tp_ranks = make(dims.groups_along("tp"))
    grid.cp_group, _ = make(dims.groups_along("cp"))
    grid.dp_group, grid.dp_ranks = make(dims.groups_along("dp"))
    grid.pp_group, grid.pp_ranks = make(dims.groups_along("pp"))

    dp_cp = sorted({tuple(sorted(dims.rank_of(tp=t, pp=p, dp=d, cp=cc) for d in range(dims.dp) for cc in range(dims.cp)))
                    for t in range(dims.tp) for p in range(dims.pp)})
    grid.dp_cp_group, _ = make([list(r) for r in dp_cp])
    mp = sorted({tuple(sorted(dims.rank_of(tp=t, pp=p, dp=d, cp=cc) for t in range(dims.tp) for p in range(dims.pp)
                              for cc in range(dims.cp))) for d in range(dims.dp)})
    grid.model_parallel_group, _ = make([list(r) for r in mp])
    ep_lists, edp_lists = dims.expert_groups()
    grid.ep_rank = dims.expert_coords(rank)["ep"]
    if dims.ep > 1:
        grid.ep_group, grid.ep_ranks = make(ep_lists)
        grid.expert_dp_group, _ = make(edp_lists)
    else:  # ep == 1: no new groups, experts are replicated over dp x cp like every other weight
        grid.ep_ranks, grid.expert_dp_group = [rank], grid.dp_cp_group
    if dims.pp > 1:
        grid.embedding_group, _ = make([[ranks[0], ranks[-1]] for ranks in dims.groups_along("pp")])
    return grid
