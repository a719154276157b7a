"""Distributed optimizer: per-rank state memory, sharded state_dict structure and resume,
configuration errors."""

import pytest
import torch
from torch import nn

from mg_parallel.distributed import DistributedDataParallel, finalize_model_grads
from mg_parallel.grid import ParallelDims, ProcessGrid, build_grid
from mg_parallel.optimizer import OptimizerConfig, build_optimizer
from mg_parallel.testing import run_distributed

from .test_training_parity import B, TinyModel, batch, full_weights, train


def _big_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128), nn.LayerNorm(128), nn.Linear(128, 97))


def _memory_worker() -> dict:
    out = {}
    for name, grid in (("dp4", build_grid(ParallelDims())), ("dp1", ProcessGrid.single())):
        model = _big_model().to(torch.bfloat16)
        ddp = DistributedDataParallel(model, grid, bucket_size_mb=0.05, use_distributed_optimizer=True,
                                      grad_reduce_in_fp32=True)
        opt = build_optimizer([ddp], grid, OptimizerConfig(precision="bf16", use_distributed_optimizer=True))
        out[name] = opt.state_bytes()
        out[f"{name}_params"] = sum(p.numel() for p in model.parameters())
    return out


def test_distributed_optimizer_state_is_a_quarter_at_dp4():
    results = run_distributed(_memory_worker, 4)
    for r in results:
        ratio = r["dp4"] / r["dp1"]
        assert abs(ratio - 0.25) <= 0.25 * 0.05, f"state bytes dp4/dp1 = {ratio:.4f}"
        # fp32 main params + two fp32 moments: 12 bytes per parameter at dp=1 (padding aside).
        assert abs(r["dp1"] / r["dp1_params"] - 12) < 0.1


def _state_worker(distributed: bool) -> dict:
    grid = build_grid(ParallelDims())
    # Uninterrupted: 6 steps. Interrupted: 3 steps, save, fresh model+optimizer, load, 3 steps.
    full, *_ = train(grid, distributed=distributed, steps=6)
    _, _, _, opt, _ = train(grid, distributed=distributed, steps=3)
    state = opt.state_dict()
    model_state = {k: v.clone() for k, v in opt.chunks[0].state_dict().items()}
    torch.manual_seed(0)
    model = TinyModel(full_weights())
    model.load_state_dict(model_state)
    ddp = DistributedDataParallel(model, grid, bucket_size_mb=0.004, use_distributed_optimizer=distributed)
    opt2 = build_optimizer([ddp], grid, OptimizerConfig(lr=1.0, weight_decay=0.0, clip_grad=0.0,
                                                        use_distributed_optimizer=distributed))
    opt2.load_state_dict(state)
    per = B // grid.dp_size
    for x, t in batch(steps=6)[3:]:
        opt2.zero_grad()
        ddp(x[:, grid.dp_rank * per : (grid.dp_rank + 1) * per], t[:, grid.dp_rank * per : (grid.dp_rank + 1) * per]).backward()
        finalize_model_grads([ddp], grid)
        opt2.step()
    err = max((p.detach() - full[-1][n]).abs().max().item() for n, p in model.named_parameters())
    entries = {n: (e["flat_offset"], e["numel"], e["shape"], e["exp_avg"].shape, e["main_param"].dtype)
               for n, e in state["chunks"][0].items()}
    bad_layout = dict(state)
    bad_layout["chunks"] = [{n: {**e, "flat_offset": e["flat_offset"] + 1} for n, e in state["chunks"][0].items()}]
    try:
        opt2.load_state_dict(bad_layout)
        bad = None
    except ValueError as e:
        bad = str(e)
    pending = cleared = None
    if distributed:
        # Overlapped param all-gather: in flight after step(), completed by the next forward.
        torch.manual_seed(0)
        model3 = TinyModel(full_weights())
        ddp3 = DistributedDataParallel(model3, grid, bucket_size_mb=0.004, use_distributed_optimizer=True)
        opt3 = build_optimizer([ddp3], grid, OptimizerConfig(use_distributed_optimizer=True, overlap_param_gather=True))
        x, t = batch(steps=1)[0]
        ddp3(x, t).backward()
        finalize_model_grads([ddp3], grid)
        opt3.step()
        pending = sum(b.gather_handle is not None for b in ddp3.buckets)
        ddp3(x, t)
        cleared = all(b.gather_handle is None for b in ddp3.buckets)
    return {"err": err, "entries": entries, "pending": pending, "cleared": cleared, "step": state["step"], "groups": state["param_groups"], "bad": bad,
            "numels": {n: p.numel() for n, p in model.named_parameters()}}


def test_state_dict_slices_and_resume():
    for distributed in (True, False):
        results = run_distributed(_state_worker, 2, distributed)
        for r in results:
            assert r["err"] < 1e-6, f"resumed training diverged (distributed={distributed}): {r['err']}"
            assert r["step"] == 3 and r["groups"][0]["lr"] == pytest.approx(1e-2)  # lr/wd come from the state
            assert r["bad"] is not None and "another parallel layout" in r["bad"]
            if distributed:
                assert r["pending"] > 1 and r["cleared"], "param all-gathers must wait for the next forward"
            for n, (_, numel, shape, st_shape, dtype) in r["entries"].items():
                assert st_shape == (numel,) and dtype == torch.float32
                assert list(shape) == list(results[0]["entries"].get(n, r["entries"][n])[2])
        # The dp ranks' slices tile each parameter's flat state exactly once.
        numels = results[0]["numels"]
        for n, total in numels.items():
            covered = sorted((r["entries"][n][0], r["entries"][n][1]) for r in results if n in r["entries"])
            if not distributed:
                assert covered == [(0, total), (0, total)]
                continue
            pos = 0
            for off, numel in covered:
                assert off == pos, f"{n}: slices {covered}"
                pos += numel
            assert pos == total


def test_config_and_builder_errors():
    with pytest.raises(ValueError, match="optimizer.precision"):
        OptimizerConfig(precision="fp8")
    with pytest.raises(ValueError, match="optimizer.clip_grad"):
        OptimizerConfig(clip_grad=-1)
    with pytest.raises(ValueError, match="optimizer.adam_beta2"):
        OptimizerConfig(adam_beta2=1.0)
    with pytest.raises(ValueError, match="overlap_param_gather"):
        OptimizerConfig(overlap_param_gather=True)
    grid = ProcessGrid.single()
    with pytest.raises(ValueError, match="wrap it in mg_parallel.distributed.DistributedDataParallel"):
        build_optimizer([_big_model()], grid, OptimizerConfig())
    with pytest.raises(ValueError, match="use_distributed_optimizer"):
        build_optimizer(DistributedDataParallel(_big_model(), grid), grid, OptimizerConfig(use_distributed_optimizer=True))
    with pytest.raises(ValueError, match=r"precision='bf16'.*\.to\(torch.bfloat16\)"):
        build_optimizer(DistributedDataParallel(_big_model(), grid), grid, OptimizerConfig(precision="bf16"))


def test_reload_model_params_after_loading_weights_single_process():
    grid = ProcessGrid.single()
    model = _big_model().to(torch.bfloat16)
    ddp = DistributedDataParallel(model, grid, use_distributed_optimizer=True)
    opt = build_optimizer([ddp], grid, OptimizerConfig(precision="bf16", lr=0.0, use_distributed_optimizer=True))
    new = {k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()}
    model.load_state_dict(new)
    opt.step()  # zero grads, lr 0: the model becomes the (stale) main params again
    assert not torch.equal(model[0].weight, new["0.weight"])
    model.load_state_dict(new)
    opt.reload_model_params()
    opt.step()
    for k, v in model.state_dict().items():
        assert torch.equal(v, new[k]), k


@pytest.mark.parametrize("fused", [True, False])
def test_adamw_update_matches_torch_adamw(fused):
    """The multi-tensor update (fused kernel and _foreach path) against torch.optim.AdamW's
    single-tensor path, over steps with a changing lr, two weight-decay groups and odd shapes."""
    from mg_parallel.optimizer.adamw import adamw_update, fused_adamw_supported

    assert fused_adamw_supported(torch.device("cpu"), torch.float32)  # torch >= 2.4 has the CPU kernel
    torch.manual_seed(0)
    shapes = [(37, 11), (5,), (1,), (64, 3, 2)]
    ref = [nn.Parameter(torch.randn(s)) for s in shapes]
    mine = [p.detach().clone() for p in ref]
    m = [torch.zeros_like(p) for p in mine]
    v = [torch.zeros_like(p) for p in mine]
    hp = dict(betas=(0.9, 0.95), eps=1e-8)
    groups = [{"params": ref[:2], "weight_decay": 0.1}, {"params": ref[2:], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1.0, foreach=False, **hp)
    for step in range(1, 8):
        lr = 1e-2 / step
        grads = [torch.randn(s) * 10 ** (step % 3 - 1) for s in shapes]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        for lo, hi, wd in ((0, 2, 0.1), (2, 4, 0.0)):
            adamw_update(mine[lo:hi], grads[lo:hi], m[lo:hi], v[lo:hi], step=step, lr=lr, beta1=0.9, beta2=0.95,
                         eps=1e-8, weight_decay=wd, fused=fused)
        for i, (a, b) in enumerate(zip(mine, ref)):
            torch.testing.assert_close(a, b.detach(), rtol=1e-6, atol=1e-7, msg=f"step {step} tensor {i}")
            torch.testing.assert_close(v[i], opt.state[b]["exp_avg_sq"], rtol=1e-6, atol=0)


def test_adamw_update_errors(monkeypatch):
    from mg_parallel.optimizer import adamw

    t = [torch.zeros(2)]
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="one of each per tensor"):
        adamw.adamw_update(t, [], t, t, step=1, **kw)
    with pytest.raises(ValueError, match="step must be >= 1"):
        adamw.adamw_update(t, t, t, t, step=0, **kw)
    # A device/dtype without the kernel: fused=True is an error, fused=None falls back to _foreach.
    monkeypatch.setitem(adamw._FUSED_OK, ("cpu", torch.float32), False)
    with pytest.raises(ValueError, match="no fused AdamW kernel"):
        adamw.adamw_update(t, t, t, t, step=1, fused=True, **kw)
    p, g = [torch.ones(3)], [torch.ones(3)]
    adamw.adamw_update(p, g, [torch.zeros(3)], [torch.zeros(3)], step=1, **kw)
    torch.testing.assert_close(p[0], torch.full((3,), 1 - 1e-3), rtol=1e-6, atol=0)  # first step moves by lr
