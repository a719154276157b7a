"""Tensor-parallel layers against plain nn.Linear / nn.Embedding built from the same full weights.

One ``run_distributed`` call per world size runs every layer check (with and without sequence
parallelism) on real processes; each rank compares its shard with the slice of the unsharded
reference computed locally, so a failure names the rank and the case.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from mg_parallel.grid import ParallelDims, ProcessGrid, build_grid
from mg_parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    normal_init_method,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
    shard_info,
)

TOL = {"rtol": 1e-5, "atol": 1e-5}
S, B, IN, OUT, VOCAB = 8, 3, 12, 16, 32


def _copy_init(full: torch.Tensor):
    def init(w: torch.Tensor) -> None:
        w.copy_(full)

    return init


def _part(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    return t.chunk(world, dim=dim)[rank]


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _check_column(grid: ProcessGrid, sp: bool, gather_output: bool, async_ar: bool, gen: torch.Generator) -> None:
    tp, r, g = grid.tp_size, grid.tp_rank, grid.tp_group
    case = f"column tp={tp} sp={sp} gather_output={gather_output} async={async_ar}"
    ref = nn.Linear(IN, OUT)
    with torch.no_grad():
        ref.bias.normal_(generator=gen)
    x = torch.randn(S, B, IN, generator=gen)
    grad_out = torch.randn(S, B, OUT, generator=gen)
    x_ref = _leaf(x)
    y_ref = ref(x_ref)
    (y_ref * grad_out).sum().backward()

    layer = ColumnParallelLinear(
        IN, OUT, tp_group=g, gather_output=gather_output, sequence_parallel=sp,
        init_method=_copy_init(ref.weight.detach()), async_grad_allreduce=async_ar,
    )
    with torch.no_grad():
        layer.bias.copy_(_part(ref.bias, 0, r, tp))
    x_local = _leaf(_part(x, 0, r, tp) if sp else x)
    y = layer(x_local)
    expect_y = y_ref if gather_output else _part(y_ref, -1, r, tp)
    g_out = grad_out if gather_output else _part(grad_out, -1, r, tp)
    assert_close(y, expect_y.detach(), **TOL, msg=lambda m: f"{case} output: {m}")
    (y * g_out).sum().backward()
    expect_dx = _part(x_ref.grad, 0, r, tp) if sp else x_ref.grad
    assert_close(x_local.grad, expect_dx, **TOL, msg=lambda m: f"{case} input grad: {m}")
    assert_close(layer.weight.grad, _part(ref.weight.grad, 0, r, tp), **TOL, msg=lambda m: f"{case} weight grad: {m}")
    assert_close(layer.bias.grad, _part(ref.bias.grad, 0, r, tp), **TOL, msg=lambda m: f"{case} bias grad: {m}")
    assert layer.weight.tensor_parallel and layer.weight.partition_dim == 0
    assert shard_info(layer.weight, grid) == ((OUT, IN), (r * OUT // tp, 0))


def _check_row(grid: ProcessGrid, sp: bool, input_is_parallel: bool, gen: torch.Generator) -> None:
    tp, r, g = grid.tp_size, grid.tp_rank, grid.tp_group
    case = f"row tp={tp} sp={sp} input_is_parallel={input_is_parallel}"
    ref = nn.Linear(OUT, IN)
    with torch.no_grad():
        ref.bias.normal_(generator=gen)
    x = torch.randn(S, B, OUT, generator=gen)
    grad_out = torch.randn(S, B, IN, generator=gen)
    x_ref = _leaf(x)
    y_ref = ref(x_ref)
    (y_ref * grad_out).sum().backward()

    layer = RowParallelLinear(
        OUT, IN, tp_group=g, input_is_parallel=input_is_parallel, sequence_parallel=sp,
        init_method=_copy_init(ref.weight.detach()),
    )
    with torch.no_grad():
        layer.bias.copy_(ref.bias)
    x_local = _leaf(_part(x, -1, r, tp) if input_is_parallel else x)
    y = layer(x_local)
    expect_y = _part(y_ref, 0, r, tp) if sp else y_ref
    g_out = _part(grad_out, 0, r, tp) if sp else grad_out
    assert_close(y, expect_y.detach(), **TOL, msg=lambda m: f"{case} output: {m}")
    (y * g_out).sum().backward()
    expect_dx = _part(x_ref.grad, -1, r, tp) if input_is_parallel else x_ref.grad
    assert_close(x_local.grad, expect_dx, **TOL, msg=lambda m: f"{case} input grad: {m}")
    assert_close(layer.weight.grad, _part(ref.weight.grad, 1, r, tp), **TOL, msg=lambda m: f"{case} weight grad: {m}")
    if sp:
        # Each rank saw only its tokens: the bias grad is partial until summed over the group.
        assert getattr(layer.bias, "sequence_parallel", False)
        if tp > 1:
            assert not torch.allclose(layer.bias.grad, ref.bias.grad, **TOL), f"{case}: bias grad already full?"
        allreduce_sequence_parallel_grads(layer, g)
    assert_close(layer.bias.grad, ref.bias.grad, **TOL, msg=lambda m: f"{case} bias grad: {m}")
    assert layer.weight.tensor_parallel and layer.weight.partition_dim == 1
    assert shard_info(layer.bias, grid) == ((IN,), (0,))


def _check_embedding(grid: ProcessGrid, sp: bool, gen: torch.Generator) -> None:
    tp, r, g = grid.tp_size, grid.tp_rank, grid.tp_group
    case = f"embedding tp={tp} sp={sp}"
    ref = nn.Embedding(VOCAB, IN)
    ids = torch.randint(0, VOCAB, (S, B), generator=gen)
    ids[0, 0], ids[1, 0] = 0, VOCAB - 1  # both ends of the vocabulary
    grad_out = torch.randn(S, B, IN, generator=gen)
    y_ref = ref(ids)
    (y_ref * grad_out).sum().backward()

    layer = VocabParallelEmbedding(VOCAB, IN, tp_group=g, sequence_parallel=sp, init_method=_copy_init(ref.weight.detach()))
    y = layer(ids)
    expect_y = _part(y_ref, 0, r, tp) if sp else y_ref
    assert_close(y, expect_y.detach(), **TOL, msg=lambda m: f"{case} output: {m}")
    (y * (_part(grad_out, 0, r, tp) if sp else grad_out)).sum().backward()
    assert_close(layer.weight.grad, _part(ref.weight.grad, 0, r, tp), **TOL, msg=lambda m: f"{case} weight grad: {m}")


def _check_mappings(grid: ProcessGrid, gen: torch.Generator) -> None:
    """Each mapping's forward and backward against its definition on the full tensor."""
    tp, r, g = grid.tp_size, grid.tp_rank, grid.tp_group
    full = torch.randn(S, B, OUT, generator=gen)
    per_rank = [torch.randn(S, B, OUT, generator=gen) for _ in range(tp)]  # rank k's own tensor
    mine = per_rank[r]
    total = torch.stack(per_rank).sum(0)
    grads = [torch.randn(S, B, OUT, generator=gen) for _ in range(tp)]
    grad_total = torch.stack(grads).sum(0)

    x = _leaf(mine)
    y = copy_to_tp_region(x, g)
    assert_close(y, mine)
    y.backward(grads[r])
    assert_close(x.grad, grad_total, **TOL)

    x = _leaf(mine)
    y = reduce_from_tp_region(x, g)
    assert_close(y, total, **TOL)
    y.backward(grads[r])
    assert_close(x.grad, grads[r])

    x = _leaf(mine)
    y = reduce_from_tp_region(x * 2, g, inplace=True)
    assert_close(y, total * 2, **TOL)
    y.backward(grads[r])
    assert_close(x.grad, grads[r] * 2)

    x = _leaf(full)
    y = scatter_to_tp_region(x, g)
    assert_close(y, _part(full, -1, r, tp))
    y.backward(_part(full, -1, r, tp) * 2)
    assert_close(x.grad, full * 2)

    x = _leaf(_part(full, -1, r, tp))
    y = gather_from_tp_region(x, g)
    assert_close(y, full)
    y.backward(full * 3)
    assert_close(x.grad, _part(full, -1, r, tp) * 3)

    x = _leaf(full)
    y = scatter_to_sequence_parallel_region(x, g)
    assert_close(y, _part(full, 0, r, tp))
    y.backward(_part(full, 0, r, tp) * 2)
    assert_close(x.grad, full * 2)

    x = _leaf(_part(full, 0, r, tp))
    y = gather_from_sequence_parallel_region(x, g)
    assert_close(y, full)
    y.backward(grads[r])
    assert_close(x.grad, _part(grad_total, 0, r, tp), **TOL)

    x = _leaf(_part(full, 0, r, tp))
    y = gather_from_sequence_parallel_region(x, g, tensor_parallel_output_grad=False)
    assert_close(y, full)
    y.backward(full * 2)
    assert_close(x.grad, _part(full, 0, r, tp) * 2)

    x = _leaf(mine)
    y = reduce_scatter_to_sequence_parallel_region(x, g)
    assert_close(y, _part(total, 0, r, tp), **TOL)
    y.backward(_part(full, 0, r, tp))
    assert_close(x.grad, full)


def _check_init(grid: ProcessGrid) -> None:
    """The full weight gathered from the shards equals the tp=1 weight for the same seed."""
    tp, g = grid.tp_size, grid.tp_group
    for make, shape, dim in (
        (lambda grp: ColumnParallelLinear(IN, OUT, tp_group=grp), (OUT, IN), 0),
        (lambda grp: RowParallelLinear(OUT, IN, tp_group=grp), (IN, OUT), 1),
        (lambda grp: VocabParallelEmbedding(VOCAB, IN, tp_group=grp), (VOCAB, IN), 0),
    ):
        torch.manual_seed(1234)
        sharded = make(g).weight.detach()
        torch.manual_seed(1234)
        single = make(None).weight.detach()
        torch.manual_seed(1234)
        independent = torch.empty(shape)
        nn.init.normal_(independent, std=0.02)
        parts = [torch.empty_like(sharded) for _ in range(tp)]
        dist.all_gather(parts, sharded.contiguous(), group=g)
        full = torch.cat(parts, dim=dim)
        assert torch.equal(full, single), f"tp={tp} init of {shape} differs from tp=1"
        assert torch.equal(full, independent), f"tp={tp} init of {shape} differs from normal_(std=0.02)"
    # A user init_method sees the full weight too.
    layer = ColumnParallelLinear(IN, OUT, tp_group=g, init_method=normal_init_method(0.0), bias=False)
    assert torch.count_nonzero(layer.weight) == 0


def _check_autocast(grid: ProcessGrid, sp: bool, gen: torch.Generator) -> None:
    """Under CPU bf16 autocast the parallel MLP runs and matches nn.Linear's under autocast."""
    tp, r, g = grid.tp_size, grid.tp_rank, grid.tp_group
    ref1, ref2 = nn.Linear(IN, OUT), nn.Linear(OUT, IN)
    x = torch.randn(S, B, IN, generator=gen)
    x_ref = _leaf(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ref = ref2(F.gelu(ref1(x_ref)))
    y_ref.float().sum().backward()
    col = ColumnParallelLinear(IN, OUT, tp_group=g, sequence_parallel=sp, init_method=_copy_init(ref1.weight.detach()))
    row = RowParallelLinear(OUT, IN, tp_group=g, sequence_parallel=sp, init_method=_copy_init(ref2.weight.detach()))
    with torch.no_grad():
        col.bias.copy_(_part(ref1.bias, 0, r, tp))
        row.bias.copy_(ref2.bias)
    x_local = _leaf(_part(x, 0, r, tp) if sp else x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = row(F.gelu(col(x_local)))
    assert y.dtype == y_ref.dtype == torch.bfloat16
    y.float().sum().backward()
    loose = {"rtol": 5e-2, "atol": 5e-2}
    case = f"autocast tp={tp} sp={sp}"
    assert_close(y.float(), (_part(y_ref, 0, r, tp) if sp else y_ref).float(), **loose, msg=lambda m: f"{case}: {m}")
    assert x_local.grad.dtype == torch.float32 and col.weight.grad.dtype == torch.float32
    assert_close(col.weight.grad, _part(ref1.weight.grad, 0, r, tp), **loose, msg=lambda m: f"{case} grad: {m}")


def _all_layer_checks(tp: int) -> str:
    grid = build_grid(ParallelDims(tp=tp))
    # Same generator seed on every rank: every rank builds the same reference inputs.
    gen = torch.Generator().manual_seed(7 + 1000 * grid.dp_rank)
    torch.manual_seed(11)  # nn.Linear / nn.Embedding reference weights, same on the tp ranks
    _check_mappings(grid, gen)
    for sp in (False, True):
        for gather_output in (False, True):
            for async_ar in (False, True):
                _check_column(grid, sp, gather_output, async_ar, gen)
        for input_is_parallel in ((True,) if sp else (True, False)):
            _check_row(grid, sp, input_is_parallel, gen)
        _check_embedding(grid, sp, gen)
        _check_autocast(grid, sp, gen)
    _check_init(grid)
    return "ok"


@pytest.mark.parametrize("world, tp", [(1, 1), (2, 2), (4, 4)])
def test_tp_layers_match_unsharded(world, tp):
    from mg_parallel.testing import run_distributed

    assert run_distributed(_all_layer_checks, world, tp) == ["ok"] * world


def test_tp_layers_tp2_inside_dp2():
    """tp=2 within a world of 4: the layers use their own group, not the world."""
    from mg_parallel.testing import run_distributed

    assert run_distributed(_all_layer_checks, 4, 2) == ["ok"] * 4


def test_single_process_is_plain_torch():
    """Without a group every layer is the plain op: same numbers, no extra autograd node."""
    torch.manual_seed(0)
    ref = nn.Linear(IN, OUT)
    col = ColumnParallelLinear(IN, OUT, init_method=_copy_init(ref.weight.detach()))
    row = RowParallelLinear(IN, OUT, init_method=_copy_init(ref.weight.detach()), sequence_parallel=True)
    with torch.no_grad():
        col.bias.copy_(ref.bias)
        row.bias.copy_(ref.bias)
    x = torch.randn(S, B, IN, requires_grad=True)
    for layer in (col, row):
        y = layer(x)
        assert y.grad_fn.name() == ref(x).grad_fn.name()
        assert_close(y, ref(x))
    emb = VocabParallelEmbedding(VOCAB, IN)
    ids = torch.randint(0, VOCAB, (S, B))
    assert_close(emb(ids), F.embedding(ids, emb.weight))
    assert emb(ids).grad_fn.name() == F.embedding(ids, emb.weight).grad_fn.name()
    for fn in (copy_to_tp_region, reduce_from_tp_region, scatter_to_tp_region, gather_from_tp_region,
               scatter_to_sequence_parallel_region, gather_from_sequence_parallel_region,
               reduce_scatter_to_sequence_parallel_region):
        assert fn(x, None) is x
    allreduce_sequence_parallel_grads(row, None)  # no group: nothing to do, no error


def test_bad_sizes_raise_clear_errors():
    with pytest.raises(ValueError, match="sequence_parallel=True requires input_is_parallel"):
        RowParallelLinear(4, 4, sequence_parallel=True, input_is_parallel=False)
    with pytest.raises(ValueError, match="init std"):
        normal_init_method(-1.0)


def _check_indivisible(tp: int) -> str:
    grid = build_grid(ParallelDims(tp=tp))
    for make, what in (
        (lambda: ColumnParallelLinear(4, 3, tp_group=grid.tp_group), "ColumnParallelLinear out_features=3"),
        (lambda: RowParallelLinear(3, 4, tp_group=grid.tp_group), "RowParallelLinear in_features=3"),
        (lambda: VocabParallelEmbedding(5, 4, tp_group=grid.tp_group), "num_embeddings"),
    ):
        with pytest.raises(ValueError, match=what):
            make()
    row = RowParallelLinear(4, 4, tp_group=grid.tp_group, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence length 3 is not divisible by the tensor-parallel size 2"):
        row(torch.randn(3, 1, 2))
    return "ok"


def test_indivisible_sizes_raise():
    from mg_parallel.testing import run_distributed

    assert run_distributed(_check_indivisible, 2, 2) == ["ok", "ok"]
