"""Process grid: validation, rank order (tp fastest, then cp, dp, pp) and real groups."""

import pytest
import torch
import torch.distributed as dist

from mg_parallel import ParallelDims, ProcessGrid, build_grid
from mg_parallel.testing import run_distributed


def test_dp_is_derived_and_order_is_tp_cp_dp_pp():
    dims = ParallelDims(tp=2, pp=2, cp=1).resolve(8)
    assert dims.dp == 2
    # torch.arange(world).view(pp, dp, cp, tp) is the documented layout.
    layout = torch.arange(8).view(2, 2, 1, 2)
    for rank in range(8):
        c = dims.coords(rank)
        assert layout[c["pp"], c["dp"], c["cp"], c["tp"]].item() == rank
        assert dims.rank_of(**c) == rank
    assert dims.groups_along("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.groups_along("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.groups_along("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize(
    "kwargs, world, match",
    [
        (dict(tp=3), 4, r"world size 4 is not divisible by tp\*pp\*cp"),
        (dict(tp=2, dp=3), 4, r"parallel.dp=3"),
        (dict(tp=0), 4, r"parallel.tp must be a positive integer"),
    ],
)
def test_bad_dims_name_the_dimension(kwargs, world, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims(**kwargs, world_size=world)


def test_check_divides_names_the_field():
    dims = ParallelDims(tp=4, world_size=4)
    with pytest.raises(ValueError, match=r"model.num_attention_heads=6 is not divisible by parallel.tp=4"):
        dims.check_divides("tp", 6, "model.num_attention_heads")


def test_single_grid_without_distributed():
    grid = build_grid(ParallelDims())
    assert isinstance(grid, ProcessGrid) and grid.tp_size == grid.dp_size == 1 and grid.tp_group is None
    with pytest.raises(ValueError, match="torchrun"):
        build_grid(ParallelDims(tp=2))


def _grid_sums(tp: int, pp: int):
    grid = build_grid(ParallelDims(tp=tp, pp=pp))
    out = {"coords": grid.coords(), "pp_ranks": grid.pp_ranks, "first": grid.is_first_stage, "last": grid.is_last_stage}
    for name in ("tp", "dp", "pp", "dp_cp", "model_parallel"):
        t = torch.tensor([float(grid.rank)])
        dist.all_reduce(t, group=getattr(grid, f"{name}_group"))
        out[name] = t.item()
    if grid.embedding_group is not None:
        t = torch.tensor([float(grid.rank)])
        dist.all_reduce(t, group=grid.embedding_group)
        out["embedding"] = t.item()
    return out


def test_groups_contain_the_right_ranks():
    results = run_distributed(_grid_sums, 4, 2, 2)
    dims = ParallelDims(tp=2, pp=2).resolve(4)
    for rank, r in enumerate(results):
        assert r["coords"] == dims.coords(rank)
        for name, dim in (("tp", "tp"), ("dp", "dp"), ("pp", "pp")):
            (group,) = [g for g in dims.groups_along(dim) if rank in g]
            assert r[name] == sum(group)
        assert r["dp_cp"] == r["dp"]  # cp == 1
        assert r["model_parallel"] == sum(range(4))  # dp == 1: every rank is one replica
        assert r["embedding"] == sum(r["pp_ranks"])  # pp == 2: first and last stage are the whole pipeline
        assert r["first"] == (r["coords"]["pp"] == 0) and r["last"] == (r["coords"]["pp"] == 1)


def test_expert_groups_are_carved_out_of_dp_cp():
    dims = ParallelDims(tp=2, cp=2, ep=2).resolve(16)  # dp = 4: each (tp, pp) has 8 dp x cp ranks
    ep_groups, edp_groups = dims.expert_groups()
    # tp rank 0: dp x cp ranks are 0, 2, 4, ..., 14 (j = cp + 2 dp); ep takes consecutive j
    assert [0, 2] in ep_groups and [4, 6] in ep_groups and [1, 3] in ep_groups
    assert [0, 4, 8, 12] in edp_groups and [2, 6, 10, 14] in edp_groups
    assert len(ep_groups) == 8 and len(edp_groups) == 4 and dims.expert_dp == 4
    for rank in range(16):
        c = dims.expert_coords(rank)
        (ep,) = [g for g in ep_groups if rank in g]
        (edp,) = [g for g in edp_groups if rank in g]
        assert ep.index(rank) == c["ep"] and edp.index(rank) == c["expert_dp"]
        assert sorted(set(ep) | set(edp)) == sorted(set(ep + edp))  # they meet in this rank only
        assert set(ep) & set(edp) == {rank}


@pytest.mark.parametrize(
    "kwargs, world, match",
    [
        (dict(ep=3), 4, r"parallel.ep=3 does not divide dp\*cp = 4\*1 = 4"),
        (dict(tp=2, ep=4), 4, r"parallel.ep=4 does not divide dp\*cp = 2\*1 = 2"),
        (dict(tp=2, etp=3), 4, r"parallel.etp=3 must be 1 or equal parallel.tp=2"),
    ],
)
def test_bad_expert_dims_name_the_field(kwargs, world, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims(**kwargs, world_size=world)


def _ep_sums():
    out = []
    for dims in (ParallelDims(ep=4), ParallelDims(cp=2, ep=2), ParallelDims(ep=1)):
        grid = build_grid(dims)
        sums = {}
        for name in ("ep", "expert_dp"):
            t, group = torch.tensor([float(grid.rank)]), getattr(grid, f"{name}_group")
            if group is not None:  # None: a group of one (ep = 1 has no ep group)
                dist.all_reduce(t, group=group)
            sums[name] = t.item()
        out.append((grid.ep_rank, grid.ep_ranks, sums))
    return out


def test_ep_groups_contain_the_right_ranks():
    results = run_distributed(_ep_sums, 4)
    for rank, per_layout in enumerate(results):
        (ep4_rank, ep4_ranks, ep4), (ep2_rank, ep2_ranks, ep2), (ep1_rank, ep1_ranks, ep1) = per_layout
        assert ep4_rank == rank and ep4_ranks == [0, 1, 2, 3] and ep4 == {"ep": 6, "expert_dp": rank}
        # cp = 2, dp = 2: j = cp + 2 dp = rank; ep pairs (0, 1), (2, 3); expert-dp pairs (0, 2), (1, 3)
        assert ep2_rank == rank % 2 and ep2_ranks == [rank - rank % 2, rank - rank % 2 + 1]
        assert ep2 == {"ep": 1 + 4 * (rank // 2), "expert_dp": 2 + 2 * (rank % 2)}
        assert ep1_rank == 0 and ep1_ranks == [rank] and ep1 == {"ep": rank, "expert_dp": 6}
