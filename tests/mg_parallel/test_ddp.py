"""DDP wrapper: bucket layout, overlap of communication with backward, no_sync accumulation,
averaged gradients equal to a single-process full-batch reference, ZeRO-2 release,
finalize_model_grads (sequence-parallel and shared-embedding all-reduces)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mg_parallel.distributed import DistributedDataParallel, finalize_model_grads
from mg_parallel.grid import ParallelDims, ProcessGrid, build_grid
from mg_parallel.testing import run_distributed

WIDTH, DEPTH = 32, 6


def make_mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


def data(seed: int = 1, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def _ddp_worker() -> dict:
    grid = build_grid(ParallelDims())
    rank, out = grid.dp_rank, {}
    x, y = data()
    xs, ys = x.chunk(2)[rank], y.chunk(2)[rank]

    # Reference gradients: one process, full batch, plain autograd.
    ref = make_mlp()
    _loss(ref, x, y).backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}

    # 1. Overlap: at the moment the *last* gradient of backward (first layer's weight) is ready,
    #    earlier buckets must already have been launched.
    for overlap in (True, False):
        model = make_mlp()
        seen, holder = [], []
        # Registered before DDP's own hook, so it observes the state just before that grad is used.
        model[0].weight.register_post_accumulate_grad_hook(
            lambda p, s=seen, h=holder: s.append([b.launched for b in h[0].buckets])
        )
        ddp = DistributedDataParallel(model, grid, bucket_size_mb=WIDTH * (WIDTH + 1) * 4 / 2**20, overlap_grad_reduce=overlap)
        holder.append(ddp)
        _loss(ddp, xs, ys).backward()
        ddp.finish_grad_sync()
        out[f"launched_at_last_grad_overlap={overlap}"] = seen[0]
        out[f"n_buckets_overlap={overlap}"] = len(ddp.buckets)
        out[f"grad_err_overlap={overlap}"] = max((p.main_grad - ref_grads[n]).abs().max().item() for n, p in model.named_parameters())

    # 2. no_sync: three micro-batches accumulate locally; the fourth reduces the sum.
    model = make_mlp()
    ddp = DistributedDataParallel(model, grid, bucket_size_mb=0.001)
    micro_x, micro_y = xs.chunk(4), ys.chunk(4)
    with ddp.no_sync():
        for i in range(3):
            (_loss(ddp, micro_x[i], micro_y[i]) / 4).backward()
    out["launched_in_no_sync"] = any(b.launched for b in ddp.buckets)
    local = model[0].weight.main_grad.clone()
    peer = local.clone()
    dist.broadcast(peer, src=0)
    out["no_sync_grads_differ_across_ranks"] = rank == 0 or not torch.equal(local, peer)
    (_loss(ddp, micro_x[3], micro_y[3]) / 4).backward()
    ddp.finish_grad_sync()
    out["accum_grad_err"] = max((p.main_grad - ref_grads[n]).abs().max().item() for n, p in model.named_parameters())
    ddp.zero_grad_buffer()
    out["zeroed"] = all(float(p.main_grad.abs().sum()) == 0 for p in model.parameters())

    # 3. A parameter unused in forward: finish_grad_sync still reduces its bucket (no hang).
    model = make_mlp()
    extra = nn.Linear(3, 3)
    holder = nn.ModuleDict({"mlp": model, "unused": extra})
    ddp = DistributedDataParallel(holder, grid, bucket_size_mb=0.001)
    _loss(model, xs, ys).backward()
    ddp.finish_grad_sync()
    out["unused_grad_err"] = max((p.main_grad - ref_grads[n]).abs().max().item() for n, p in model.named_parameters())

    # 4. Reduce-scatter (distributed optimizer) + ZeRO-2: the local shard holds the average; the
    #    bucket storage can be released and comes back zeroed on the next backward.
    for stage in (1, 2):
        model = make_mlp()
        ddp = DistributedDataParallel(model, grid, bucket_size_mb=0.003, use_distributed_optimizer=True, zero_stage=stage)
        ref_flat = {id(p): ref_grads[n].reshape(-1) for n, p in model.named_parameters()}
        out[f"padded_stage{stage}"] = all(b.numel % 64 == 0 and b.numel % grid.dp_size == 0 for b in ddp.buckets)
        for rep in range(2):
            _loss(ddp, xs, ys).backward()
            ddp.finish_grad_sync()
            err = 0.0
            for buf in ddp.buffers:
                for b in buf.buckets:
                    lo, hi = ddp.local_shard(b)
                    for p in b.params:
                        slot = buf.slots[id(p)]
                        s, e = max(slot.start - b.start, lo), min(slot.end - b.start, hi)
                        if s < e:
                            got = b.grad_data[s:e]
                            want = ref_flat[id(p)][s - (slot.start - b.start) : e - (slot.start - b.start)]
                            err = max(err, (got - want).abs().max().item())
            out[f"rs_err_stage{stage}_rep{rep}"] = err
            ddp.release_grad_buffers()
            out[f"released_stage{stage}"] = all(b.grad_data.untyped_storage().size() == 0 for b in ddp.buckets)
            ddp.zero_grad_buffer()

    # 5. A gradient arriving twice in one synchronised backward is an error, not silent corruption.
    model = make_mlp()
    ddp = DistributedDataParallel(model, grid, bucket_size_mb=0.001)
    h = model(xs)
    try:
        (h.sum() + model(xs).sum()).backward()
        ddp.finish_grad_sync()
        out["double_ok"] = True  # the same param used twice in one graph accumulates once: fine
    except RuntimeError:
        out["double_ok"] = False
    ddp.zero_grad_buffer()
    _loss(ddp, xs, ys).backward(retain_graph=False)
    try:
        _loss(ddp, xs, ys).backward()
        out["second_backward_error"] = None
    except RuntimeError as e:
        out["second_backward_error"] = str(e)
    ddp.finish_grad_sync()
    return out


def test_ddp_two_ranks():
    results = run_distributed(_ddp_worker, 2)
    for rank, r in enumerate(results):
        assert r["n_buckets_overlap=True"] >= 3
        launched = r["launched_at_last_grad_overlap=True"]
        # Every bucket but the one waiting for this very gradient is already in flight.
        assert all(launched[:-1]) and not launched[-1], f"rank {rank}: buckets launched at the last grad: {launched}"
        assert not any(r["launched_at_last_grad_overlap=False"])
        for key in ("grad_err_overlap=True", "grad_err_overlap=False", "accum_grad_err", "unused_grad_err",
                    "rs_err_stage1_rep0", "rs_err_stage1_rep1", "rs_err_stage2_rep0", "rs_err_stage2_rep1"):
            assert r[key] < 1e-6, f"rank {rank}: {key} = {r[key]}"
        assert not r["launched_in_no_sync"] and r["no_sync_grads_differ_across_ranks"] and r["zeroed"]
        assert r["padded_stage1"] and r["padded_stage2"]
        assert r["released_stage2"] and not r["released_stage1"]
        assert r["double_ok"]
        assert r["second_backward_error"] is not None and "no_sync" in r["second_backward_error"]


def _finalize_worker() -> dict:
    out = {}
    # Sequence-parallel params: partial grads summed over tp (tp=2, dp=1).
    grid = build_grid(ParallelDims(tp=2))
    norm = nn.LayerNorm(4)
    for p in norm.parameters():
        p.sequence_parallel = True
    other = nn.Linear(4, 4)
    holder = nn.ModuleDict({"norm": norm, "other": other})
    ddp = DistributedDataParallel(holder, grid)
    x = torch.full((2, 4), float(grid.tp_rank + 1))
    x[:, 0] = 0
    (norm(x).sum() * (grid.tp_rank + 1) + other(x).sum()).backward()
    before_other = other.weight.main_grad.clone()
    before = norm.bias.main_grad.clone()
    finalize_model_grads([ddp], grid)
    out["sp_bias"] = norm.bias.main_grad.clone()
    out["sp_bias_before"] = before
    out["other_unchanged"] = torch.equal(before_other, other.weight.main_grad)

    # Shared embedding over the embedding group (pp=2): first and last stage grads are summed.
    grid = build_grid(ParallelDims(pp=2))
    emb = nn.Embedding(5, 3)
    emb.weight.shared_embedding = True
    ddp = DistributedDataParallel(nn.ModuleDict({"emb": emb, "x": nn.Linear(3, 1)}), grid, use_distributed_optimizer=True)
    out["shared_own_bucket"] = any(b.params == [emb.weight] for b in ddp.buckets)
    emb(torch.tensor([grid.pp_rank, 4])).sum().mul(grid.pp_rank + 1).backward()
    finalize_model_grads([ddp], grid)
    out["emb_grad"] = emb.weight.main_grad.clone()
    return out


def test_finalize_model_grads_sp_and_shared_embedding():
    results = run_distributed(_finalize_worker, 2)
    total = results[0]["sp_bias_before"] + results[1]["sp_bias_before"]
    for r in results:
        torch.testing.assert_close(r["sp_bias"], total)
        assert r["other_unchanged"] and r["shared_own_bucket"]
    # Stage 0 looks up rows 0 and 4 (x1), stage 1 rows 1 and 4 (x2); both end with the sum.
    want = torch.zeros(5, 3)
    want[0] += 1
    want[1] += 2
    want[4] += 3
    for r in results:
        torch.testing.assert_close(r["emb_grad"], want)


def test_ddp_options_are_validated_single_process():
    grid = ProcessGrid.single()
    with pytest.raises(ValueError, match="zero_stage=2 needs use_distributed_optimizer"):
        DistributedDataParallel(make_mlp(), grid, zero_stage=2)
    with pytest.raises(ValueError, match="bucket_size_mb"):
        DistributedDataParallel(make_mlp(), grid, bucket_size_mb=0)
    # Single process: main_grad equals autograd's gradient; state_dict has no "module." prefix.
    ref, model = make_mlp(), make_mlp()
    ddp = DistributedDataParallel(model, grid, bucket_size_mb=0.001, grad_reduce_in_fp32=True)
    x, y = data()
    _loss(ref, x, y).backward()
    _loss(ddp, x, y).backward()
    ddp.finish_grad_sync()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.main_grad, q.grad, msg=n)
        assert p.grad is None
    assert set(ddp.state_dict()) == set(ref.state_dict())


def _unwrapped_worker() -> dict:
    grid = build_grid(ParallelDims())  # dp=2
    wrapped = DistributedDataParallel(nn.Linear(2, 2), grid)
    try:
        finalize_model_grads([wrapped, nn.Linear(2, 2)], grid)
    except ValueError as e:
        return {"error": str(e)}
    return {"error": None}


def test_finalize_rejects_an_unwrapped_chunk_at_dp2():
    for r in run_distributed(_unwrapped_worker, 2):
        assert r["error"] is not None and r["error"].startswith("model chunk 1 is a Linear, not wrapped in "
                                                                "mg_parallel.distributed.DistributedDataParallel")
        assert "dp*cp=2" in r["error"]
    # One replica: nothing to average, so a plain module is fine (e.g. the pipeline tests' stages).
    finalize_model_grads([nn.Linear(2, 2)], ProcessGrid.single())

