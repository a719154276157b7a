"""Mixed precision: bf16/fp16 loss curves track fp32; an fp16 overflow on one rank makes every
rank skip the step and back off the loss scale; loss-scaler rules."""

import pytest

from mg_parallel.grid import ParallelDims, build_grid
from mg_parallel.optimizer import ConstantLossScaler, DynamicLossScaler
from mg_parallel.testing import run_distributed

from .test_training_parity import train

# Stated tolerance: over 10 AdamW steps, the mean loss of a low-precision run stays within
# these absolute distances of the fp32 run (losses are ~3.3).
TOL = {"bf16": 0.06, "fp16": 0.02}


def _inject_inf(step: int, ddp, grid) -> None:
    if step == 3 and grid.dp_rank == 1:
        bucket = ddp.buckets[0]
        lo, _ = ddp.local_shard(bucket)
        bucket.grad_data[lo] = float("inf")  # only in rank 1's shard: rank 0 sees finite grads


def _precision_worker() -> dict:
    grid = build_grid(ParallelDims())
    out = {}
    for precision in ("fp32", "bf16", "fp16"):
        for distributed in (False, True):
            _, losses, _, opt, applied = train(grid, distributed=distributed, precision=precision, clip=1.0)
            out[f"{precision},{distributed}"] = (losses, applied)
    params, _, _, opt, applied = train(grid, distributed=True, precision="fp16", hook=_inject_inf,
                                       extra={"hysteresis": 1}, steps=6)
    out["overflow_applied"] = applied
    out["overflow_scale"] = opt.loss_scale
    out["overflow_unchanged"] = all((params[3][n] == params[2][n]).all().item() for n in params[3])
    out["overflow_moved_after"] = any((params[4][n] != params[3][n]).any().item() for n in params[4])
    return out


def test_low_precision_tracks_fp32_and_overflow_skips_everywhere():
    results = run_distributed(_precision_worker, 2, timeout=240)
    for rank, r in enumerate(results):
        for distributed in (False, True):
            ref, _ = r[f"fp32,{distributed}"]
            for precision, tol in TOL.items():
                losses, applied = r[f"{precision},{distributed}"]
                assert all(applied)
                worst = max(abs(a - b) for a, b in zip(losses, ref))
                assert worst < tol, f"rank {rank} {precision} distributed={distributed}: loss gap {worst}"
            assert ref[-1] < ref[0] - 0.1, "the fp32 run must actually train"
        assert r["overflow_applied"] == [True, True, True, False, True, True], f"rank {rank}: {r['overflow_applied']}"
        assert r["overflow_scale"] == 2.0**15
        assert r["overflow_unchanged"] and r["overflow_moved_after"]


def test_dynamic_loss_scaler_rules():
    s = DynamicLossScaler(1024.0, growth_interval=3, hysteresis=2, min_scale=256.0)
    s.update(True)
    assert s.scale == 1024.0  # first overflow absorbed by hysteresis
    s.update(True)
    assert s.scale == 512.0
    s.update(True)
    assert s.scale == 256.0  # hysteresis is refilled only on growth
    s.update(True)
    assert s.scale == 256.0  # min_scale floor
    for _ in range(3):
        s.update(False)
    assert s.scale == 512.0
    s.update(True)
    assert s.scale == 512.0  # hysteresis refilled after growth
    state = s.state_dict()
    t = DynamicLossScaler(1.0, growth_interval=3, hysteresis=2)
    t.load_state_dict(state)
    assert t.state_dict() == state
    c = ConstantLossScaler(8.0)
    c.update(True)
    assert c.scale == 8.0
    with pytest.raises(ValueError):
        DynamicLossScaler(backoff_factor=1.5)
