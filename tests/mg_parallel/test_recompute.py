"""Activation recomputation: with dropout on, grads equal those of the run without recompute."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from mg_parallel.grid import ParallelDims, ProcessGrid, build_grid
from mg_parallel.recompute import RecomputeConfig, recompute
from mg_parallel.tensor_parallel import RNGTracker, allreduce_sequence_parallel_grads
from tests.mg_parallel.test_tp_block import LAYERS, B, H, ParallelModel, RefLayer, S, load_from_reference

EXACT = {"rtol": 0.0, "atol": 1e-6}


def _train_step(grid, sp: bool, cfg: RecomputeConfig, dropout: float, tracker: RNGTracker, start: tuple):
    torch.manual_seed(5)
    ref = nn.ModuleList(RefLayer() for _ in range(LAYERS))
    model = ParallelModel(grid.tp_group, sp, dropout=dropout, rng_tracker=tracker, recompute_cfg=cfg)
    load_from_reference(model, ref)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(S, B, H, generator=gen).requires_grad_(True)
    grad_out = torch.randn(S, B, H, generator=gen)
    streams, default = start
    tracker.set_state(streams)
    tracker.set_default_state(default)
    y = model(x)
    (y * grad_out).sum().backward()
    allreduce_sequence_parallel_grads(model, grid.tp_group)
    grads = [p.grad.clone() for p in model.parameters()]
    return y.detach(), x.grad, grads, tracker.get_default_state(), tracker.get_state()


def _check(grid, sp: bool) -> None:
    tracker = RNGTracker(42, grid)
    start = (tracker.get_state(), tracker.get_default_state())
    base = _train_step(grid, sp, RecomputeConfig(), 0.3, tracker, start)
    no_dropout = _train_step(grid, sp, RecomputeConfig(), 0.0, tracker, start)
    assert not torch.allclose(base[0], no_dropout[0]), "dropout had no effect: the test would prove nothing"
    for cfg in (
        RecomputeConfig(granularity="full"),
        RecomputeConfig(granularity="full", num_layers=1),
        RecomputeConfig(granularity="selective"),
    ):
        case = f"tp={grid.tp_size} sp={sp} {cfg}"
        got = _train_step(grid, sp, cfg, 0.3, tracker, start)
        assert_close(got[0], base[0], **EXACT, msg=lambda m, case=case: f"{case} output: {m}")
        assert_close(got[1], base[1], **EXACT, msg=lambda m, case=case: f"{case} input grad: {m}")
        for i, (g, g_base) in enumerate(zip(got[2], base[2])):
            assert_close(g, g_base, **EXACT, msg=lambda m, i=i, case=case: f"{case} grad of param {i}: {m}")
        # Recomputation must not consume random numbers: the streams end where they did.
        assert torch.equal(got[3], base[3]), f"{case}: default RNG stream advanced differently"
        for name in base[4]:
            assert torch.equal(got[4][name], base[4][name]), f"{case}: stream {name} advanced differently"


def _check_all(tp: int) -> str:
    grid = build_grid(ParallelDims(tp=tp))
    for sp in (False, True) if tp > 1 else (False,):
        _check(grid, sp)
    return "ok"


@pytest.mark.parametrize("world", [1, 2])
def test_recompute_with_dropout_matches_plain(world):
    from mg_parallel.testing import run_distributed

    assert run_distributed(_check_all, world, world) == ["ok"] * world


def test_recompute_without_process_group():
    _check(ProcessGrid.single(torch.device("cpu")), sp=False)


def test_tracker_streams_must_be_restored():
    """Negative control: recomputing forked dropout without the tracker gives other grads."""
    tracker = RNGTracker(3, ProcessGrid.single(torch.device("cpu")))

    def fn(x: torch.Tensor) -> torch.Tensor:
        with tracker.fork():
            return F.dropout(x, 0.5, True) * x

    start = tracker.get_state()
    results = []
    for mode in ("plain", "tracked", "untracked"):
        tracker.set_state(start)
        x = torch.ones(64, requires_grad=True)
        if mode == "plain":
            y = fn(x)
        else:
            y = recompute(fn, x, rng_tracker=tracker if mode == "tracked" else None)
        y.sum().backward()
        results.append(x.grad)
    assert torch.equal(results[0], results[1])
    assert not torch.equal(results[0], results[2])


def test_no_grad_calls_directly():
    with torch.no_grad():
        assert recompute(lambda a, b: a + b, torch.ones(2), b=torch.ones(2)).tolist() == [2.0, 2.0]


def test_recompute_config_validation():
    assert RecomputeConfig(granularity="full", num_layers=2).recompute_layer(1)
    assert not RecomputeConfig(granularity="full", num_layers=2).recompute_layer(2)
    assert RecomputeConfig(granularity="selective").recompute_core_attention
    assert not RecomputeConfig().recompute_layer(0)
    with pytest.raises(ValueError, match="granularity"):
        RecomputeConfig(granularity="everything")
    with pytest.raises(ValueError, match="num_layers only applies"):
        RecomputeConfig(granularity="selective", num_layers=1)
    with pytest.raises(ValueError, match="num_layers must be"):
        RecomputeConfig(granularity="full", num_layers=-1)
