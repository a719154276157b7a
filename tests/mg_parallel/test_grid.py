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
