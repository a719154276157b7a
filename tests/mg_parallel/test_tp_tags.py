"""Tensor-parallel tags: every parameter of the parallel layers is tagged at construction; at tp > 1
an untagged parameter is an error naming it (grad norm, checkpoint slicing), not a guess."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from mg_parallel.distributed import DistributedDataParallel
from mg_parallel.grid import ParallelDims, build_grid
from mg_parallel.optimizer import OptimizerConfig, build_optimizer, counts_in_norm
from mg_parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    is_tensor_parallel,
    mark_replicated,
    mark_sequence_parallel,
    set_tensor_parallel,
    shard_info,
)
from mg_parallel.testing import run_distributed


def _grid(tp: int, tp_rank: int = 0) -> SimpleNamespace:
    return SimpleNamespace(tp_size=tp, tp_rank=tp_rank, pp_size=1, is_first_stage=True, cp_rank=0)


def test_parallel_layers_tag_every_parameter():
    col, row = ColumnParallelLinear(4, 8), RowParallelLinear(8, 4)
    emb = VocabParallelEmbedding(16, 4)
    tags = {f"{prefix}.{n}": (p.tensor_parallel, getattr(p, "partition_dim", None))
            for m, prefix in ((col, "col"), (row, "row"), (emb, "emb")) for n, p in m.named_parameters()}
    assert tags == {"col.weight": (True, 0), "col.bias": (True, 0), "row.weight": (True, 1),
                    "row.bias": (False, None), "emb.weight": (True, 0)}
    norm = mark_sequence_parallel(nn.LayerNorm(4))  # a sequence-parallel module is a replicated one
    assert all(p.tensor_parallel is False and p.sequence_parallel for p in norm.parameters())


def test_mark_replicated_keeps_existing_tags():
    block = nn.ModuleDict({"norm": nn.LayerNorm(4), "fc": ColumnParallelLinear(4, 8)})
    mark_replicated(block)
    assert not block["norm"].weight.tensor_parallel and block["fc"].weight.tensor_parallel
    p = set_tensor_parallel(nn.Parameter(torch.zeros(2, 3)), 1)
    assert is_tensor_parallel(p) and p.partition_dim == 1
    assert is_tensor_parallel(set_tensor_parallel(p, None)) is False


def test_untagged_parameter_is_an_error_at_tp2_only():
    bare = nn.Parameter(torch.zeros(3, 5))
    with pytest.raises(ValueError, match=r"parameter 'norm.weight' has no tensor_parallel tag.*mark_replicated"):
        is_tensor_parallel(bare, "norm.weight")
    with pytest.raises(ValueError, match=r"a parameter of shape \[3, 5\] has no tensor_parallel tag"):
        is_tensor_parallel(bare)
    for tp_rank in (0, 1):  # every tp rank raises alike: none is left waiting in a collective
        with pytest.raises(ValueError, match="'head.weight' has no tensor_parallel tag"):
            counts_in_norm(bare, _grid(2, tp_rank), sharded_over_dp=False, name="head.weight")
    with pytest.raises(ValueError, match="'head.weight' has no tensor_parallel tag"):
        shard_info(bare, _grid(2, 1), name="head.weight")
    # At tp = 1 a tag changes nothing, so none is required.
    assert counts_in_norm(bare, _grid(1), sharded_over_dp=False)
    assert shard_info(bare, _grid(1)) == ((3, 5), (0, 0))
    tagged = set_tensor_parallel(nn.Parameter(torch.zeros(3, 5)), 1)
    assert counts_in_norm(tagged, _grid(2, 1), sharded_over_dp=False)
    assert shard_info(tagged, _grid(2, 1)) == ((3, 10), (0, 5))


def _untagged_worker() -> dict:
    grid = build_grid(ParallelDims(tp=2))
    out = {}
    for tagged in (False, True):
        model = nn.ModuleDict({"fc": ColumnParallelLinear(4, 8, tp_group=grid.tp_group), "norm": nn.LayerNorm(4)})
        if tagged:
            mark_replicated(model["norm"])
        try:
            build_optimizer([DistributedDataParallel(model, grid)], grid, OptimizerConfig())
            out[tagged] = "built"
        except ValueError as e:
            out[tagged] = str(e)
    return out


def test_optimizer_names_an_untagged_parameter_at_tp2():
    for r in run_distributed(_untagged_worker, 2):
        assert r[True] == "built"
        assert r[False].startswith("parameter 'norm.")
        assert "has no tensor_parallel tag" in r[False]
