"""Mixed precision: bf16/fp16 loss curves track fp32; an fp16 overflow on one rank makes every
rank skip the step and back off the loss scale; loss-scaler rules; the precision policy."""

import pytest
import torch
from torch import nn

from mg_parallel import Precision
from mg_parallel.distributed import DistributedDataParallel
from mg_parallel.grid import ParallelDims, ProcessGrid, build_grid
from mg_parallel.optimizer import ConstantLossScaler, DynamicLossScaler, OptimizerConfig, build_optimizer
from mg_parallel.precision import PRECISION_NAMES, LossScaling
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


@pytest.mark.parametrize("name, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_precision_policy_dtypes(name, dtype):
    p = Precision.from_name(name)
    assert (p.name, p.param_dtype, p.compute_dtype) == (name, dtype, dtype)
    assert p.grad_reduce_dtype == torch.float32 and p.main_param_dtype == torch.float32
    assert Precision.resolve(name) == p and Precision.resolve(p) is p
    with pytest.raises(AttributeError):
        p.param_dtype = torch.float64  # frozen: one policy object can be shared safely


def test_precision_policy_loss_scaler():
    assert Precision.from_name("fp32").build_loss_scaler() is None
    assert Precision.from_name("bf16").build_loss_scaler(loss_scale=8.0) is None  # bf16 never scales
    fp16 = Precision.from_name("fp16")
    dynamic = fp16.build_loss_scaler(initial_loss_scale=1024.0, min_loss_scale=4.0, loss_scale_window=7, hysteresis=3)
    assert isinstance(dynamic, DynamicLossScaler)
    assert (dynamic.scale, dynamic.min_scale, dynamic.growth_interval, dynamic.hysteresis) == (1024.0, 4.0, 7, 3)
    constant = fp16.build_loss_scaler(loss_scale=128.0, initial_loss_scale=1024.0)
    assert type(constant) is ConstantLossScaler and constant.scale == 128.0
    with pytest.raises(ValueError, match="loss_scale must be > 0"):
        fp16.build_loss_scaler(loss_scale=0.0)


def test_precision_policy_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown precision 'fp8'; choose one of fp32, bf16, fp16"):
        Precision.from_name("fp8")
    assert PRECISION_NAMES == ("fp32", "bf16", "fp16")
    with pytest.raises(ValueError, match=r"optimizer.precision must be one of \('fp32', 'bf16', 'fp16'\)"):
        OptimizerConfig(precision="fp8")


def test_ddp_and_optimizer_follow_the_policy():
    grid = ProcessGrid.single()
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)).to(torch.bfloat16)
    ddp = DistributedDataParallel(model, grid, precision="bf16")
    assert ddp.precision == Precision.from_name("bf16")
    assert [buf.grad_dtype for buf in ddp.buffers] == [torch.float32]
    opt = build_optimizer([ddp], grid, OptimizerConfig(precision="bf16"))
    assert opt.precision.name == "bf16" and opt.scaler is None
    assert all(piece.main.dtype == torch.float32 for piece in opt.pieces)
    # The keyword of before still decides when no policy is given; a contradiction is an error.
    plain = DistributedDataParallel(nn.Linear(4, 4).to(torch.bfloat16), grid)
    assert [buf.grad_dtype for buf in plain.buffers] == [torch.bfloat16]
    with pytest.raises(ValueError, match="grad_reduce_in_fp32=False contradicts precision='fp16'"):
        DistributedDataParallel(nn.Linear(4, 4).half(), grid, precision=Precision.from_name("fp16"),
                                grad_reduce_in_fp32=False)
    with pytest.raises(ValueError, match="unknown precision 'float16'"):
        DistributedDataParallel(nn.Linear(4, 4), grid, precision="float16")
    fp16 = build_optimizer([DistributedDataParallel(nn.Linear(4, 4).half(), grid, precision="fp16")], grid,
                           OptimizerConfig(precision="fp16", loss_scale=64.0))
    assert isinstance(fp16.scaler, ConstantLossScaler) and fp16.loss_scale == 64.0


def test_the_policy_carries_its_loss_scaling_and_the_optimizer_takes_the_object():
    """OptimizerConfig.precision_policy() is the key's policy with its loss scaling; build_optimizer keeps the object
    it is given (recipe and scaling included) and refuses one of another name."""
    from mg_parallel.gemm import Gemm

    class Recipe(Gemm):
        pass

    config = OptimizerConfig(precision="fp16", loss_scale=32.0)
    policy = config.precision_policy(gemm=Recipe())
    assert policy.name == "fp16" and isinstance(policy.gemm, Recipe)
    assert policy.loss_scaling == LossScaling(loss_scale=32.0)
    dynamic = OptimizerConfig(precision="fp16", initial_loss_scale=8.0, loss_scale_window=5).precision_policy()
    scaler = dynamic.build_loss_scaler()
    assert isinstance(scaler, DynamicLossScaler) and (scaler.scale, scaler.growth_interval) == (8.0, 5)
    assert isinstance(dynamic.build_loss_scaler(loss_scale=2.0), ConstantLossScaler)  # an override wins
    grid = ProcessGrid.single()
    ddp = DistributedDataParallel(nn.Linear(4, 4).half(), grid, precision=policy)
    opt = build_optimizer([ddp], grid, config, precision=policy)
    assert opt.precision is policy and isinstance(opt.scaler, ConstantLossScaler) and opt.loss_scale == 32.0
    with pytest.raises(ValueError, match=r"precision='bf16' but optimizer.precision='fp16'"):
        build_optimizer([DistributedDataParallel(nn.Linear(4, 4).half(), grid, precision=policy)], grid, config,
                        precision=Precision.from_name("bf16"))
    with pytest.raises(ValueError, match="loss_scale_window and hysteresis must be >= 1"):
        LossScaling(hysteresis=0)
