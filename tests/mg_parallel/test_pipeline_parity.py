"""Pipeline schedules against the same model trained in one process (gloo, fp32).

Each ``run_distributed`` call runs many cases on the same worker processes: per case, every rank
builds its stage(s) of the tiny GPT-like stack, trains STEPS steps with SGD through the schedule
and returns its parameters (under the full model's names), the loss every rank reports, an eval
loss (forward-only schedule), the executed op order and the peak number of live activations.
"""

from __future__ import annotations

import pytest
import torch

from mg_parallel import ParallelDims, build_grid
from mg_parallel.distributed import DistributedDataParallel
from mg_parallel.optimizer import OptimizerConfig, build_optimizer
from mg_parallel.pipeline import (
    ScheduleRecorder,
    allreduce_shared_embedding_grads,
    average_losses,
    get_forward_backward_func,
    partition_layers,
)
from mg_parallel.testing import run_distributed
from tests.mg_parallel import test_pipeline_model as M

_GRIDS: dict = {}


def _grid(tp: int, pp: int):
    key = (tp, pp)
    if key not in _GRIDS:  # groups are created once per worker process
        _GRIDS[key] = build_grid(ParallelDims(tp=tp, pp=pp))
    return _GRIDS[key]


def _forward_step(batch, model):
    tokens, labels = batch
    output = model(tokens)
    return output, lambda logits: (M.microbatch_loss(logits, labels), {"tokens": labels.numel()})


def _train(case: dict) -> dict:
    torch.manual_seed(0)
    pp, vpp, m, tp, sp = case["pp"], case.get("vpp", 1), case["m"], case.get("tp", 1), case.get("sp", False)
    tied, scale, ddp = case.get("tied", False), case.get("loss_scale"), case.get("ddp", False)
    grid = _grid(tp, pp)
    ranges = partition_layers(M.NUM_LAYERS, pp, vpp, case.get("first"), case.get("last"))[grid.pp_rank]
    stages = [
        M.Stage(r, first=grid.is_first_stage and c == 0, last=grid.is_last_stage and c == vpp - 1, tied=tied,
                recompute=case.get("recompute", False), grid=grid, sp=sp)
        for c, r in enumerate(ranges)
    ]
    params = [p for chunk in stages for p in chunk.parameters()]
    if ddp:
        distributed = case.get("distopt", False)
        chunks = [DistributedDataParallel(s, grid, bucket_size_mb=0.01, use_distributed_optimizer=distributed)
                  for s in stages]
        opt = build_optimizer(chunks, grid, OptimizerConfig(lr=M.ADAM_LR, weight_decay=0.0, clip_grad=M.CLIP,
                                                             use_distributed_optimizer=distributed))
        scale = None
    else:
        chunks = stages
        opt = torch.optim.SGD(params, lr=M.LR, momentum=M.MOMENTUM)
    schedule = get_forward_backward_func(grid, vpp if vpp > 1 else None)
    seq = M.SEQ // tp if sp else M.SEQ  # sequence parallelism sends this rank's shard of the sequence
    kwargs = dict(tensor_shape=(seq, M.MICRO_BATCH, M.HIDDEN), dtype=torch.float32)
    if case.get("own_finalize"):
        kwargs["finalize_grads"] = allreduce_shared_embedding_grads
    ours = slice(grid.dp_rank * m, (grid.dp_rank + 1) * m)
    recorder, losses, max_live = ScheduleRecorder(), [], 0

    def peak(pp_rank, chunk, microbatch, kind, t0, t1):
        nonlocal max_live
        recorder(pp_rank, chunk, microbatch, kind, t0, t1)
        max_live = max(max_live, len(M.LIVE_OUTPUTS))

    for step in range(M.STEPS):
        opt.zero_grad()
        out = schedule(_forward_step, iter(M.make_batches(step, m * grid.dp_size)[ours]), chunks, m, grid,
                       recorder=peak if step == 0 else None,
                       scale_loss=opt.scale_loss if ddp else (lambda loss: loss * scale) if scale else None, **kwargs)
        if scale:
            for p in params:
                p.grad /= scale
        assert (len(out) == m) == grid.is_last_stage
        losses.append(average_losses(out, grid))
        opt.step()
    evals = schedule(_forward_step, iter(M.make_batches(M.STEPS, m * grid.dp_size)[ours]), chunks, m, grid,
                     forward_only=True, **kwargs)
    params_out = {}
    for stage in stages:
        params_out.update(stage.global_params(tied))
    return {"losses": losses, "eval": average_losses(evals, grid), "params": params_out, "order": recorder.order(),
            "max_live": max_live, "pp_rank": grid.pp_rank, "tp_rank": grid.tp_rank, "dp_rank": grid.dp_rank}


def _train_cases(cases: list[dict]) -> list[dict]:
    return [_train(case) for case in cases]


def _check(case: dict, per_rank: list[dict]) -> None:
    dp = len(per_rank) // (case["pp"] * case.get("tp", 1))
    ref_losses, ref_eval, ref_params = M.reference_run(case["m"] * dp, tied=case.get("tied", False),
                                                       adam=case.get("ddp", False))
    # Join tensor-parallel shards: rank (tp=0) collects its peers' shards in tp order.
    for r in per_rank:
        for name, value in r["params"].items():
            if isinstance(value, tuple) and r["tp_rank"] == 0:
                peers = sorted((q for q in per_rank if (q["pp_rank"], q["dp_rank"]) == (r["pp_rank"], r["dp_rank"])),
                               key=lambda q: q["tp_rank"])
                r["params"][name] = torch.cat([q["params"][name][0] for q in peers], dim=value[1])
    seen = set()
    for r in per_rank:
        if r["tp_rank"] != 0:
            continue
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6,
                                   msg=lambda s: f"{case}: losses differ: {s}")
        assert r["eval"] == pytest.approx(ref_eval, rel=1e-5), case
        for name, value in r["params"].items():
            torch.testing.assert_close(value, ref_params[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda s, name=name: f"{case}: parameter {name} differs: {s}")
            seen.add(name)
    assert seen == set(ref_params), f"{case}: parameters missing from every stage: {set(ref_params) - seen}"


def _expected_order(pp_rank: int, pp: int, vpp: int, m: int) -> list[tuple[str, int, int]]:
    # 1F1B / interleaved order as described for Megatron's schedules: microbatches pass the chunks
    # in groups of pp; warm-up pp-r-1 forwards (1F1B) or 2(pp-r-1)+(v-1)pp (interleaved).
    if vpp == 1:
        fwd = [(0, i) for i in range(m)]
        bwd = list(fwd)
        warm = min(pp - pp_rank - 1, m)
    else:
        fwd = [(c, g * pp + i) for g in range(m // pp) for c in range(vpp) for i in range(pp)]
        bwd = [(c, g * pp + i) for g in range(m // pp) for c in reversed(range(vpp)) for i in range(pp)]
        warm = min(2 * (pp - pp_rank - 1) + (vpp - 1) * pp, m * vpp)
    order = [("F", *f) for f in fwd[:warm]]
    for f, b in zip(fwd[warm:], bwd):
        order += [("F", *f), ("B", *b)]
    order += [("B", *b) for b in bwd[len(fwd) - warm:]]
    return order


def _check_schedule(case: dict, per_rank: list[dict]) -> None:
    pp, vpp, m = case["pp"], case.get("vpp", 1), case["m"]
    for r in per_rank:
        rank = r["pp_rank"]
        assert r["order"] == _expected_order(rank, pp, vpp, m), f"{case}: rank {rank} ran {r['order']}"
        # Memory bound: 1F1B keeps at most pp - rank microbatches in flight; interleaved its warm-up + 1.
        bound = min(pp - rank, m) if vpp == 1 else min(2 * (pp - rank - 1) + (vpp - 1) * pp + 1, m * vpp)
        if not case.get("recompute"):
            assert r["max_live"] <= bound, f"{case}: rank {rank} held {r['max_live']} activations > {bound}"


# Microbatch counts below, equal to and above the number of stages; uneven splits; tied
# embeddings; recomputation; loss scaling; tp (+ sequence parallel); dp with DDP and the
# distributed optimizer. Few cases per world size keep the suite within its time budget.
CASES_2 = [
    dict(pp=2, m=1),  # fewer microbatches than stages
    dict(pp=2, m=2),
    dict(pp=2, m=5),
    dict(pp=2, vpp=2, m=4),
    dict(pp=2, m=3, first=3, last=5, loss_scale=1024.0),
    dict(pp=2, m=3, tied=True, own_finalize=True),  # the pipeline's own tied-embedding reduction
    dict(pp=2, vpp=2, m=4, tied=True, recompute=True),
    dict(pp=1, m=3, ddp=True),  # no pipelining, dp=2: DDP's no_sync for all but the last microbatch
]
CASES_4 = [
    dict(pp=4, m=2),
    dict(pp=4, m=7, tied=True),
    dict(pp=4, vpp=2, m=4),
    dict(pp=4, m=4, first=1, last=1),
    dict(pp=4, vpp=2, m=4, first=0, last=2),
    dict(pp=2, tp=2, m=3),
    dict(pp=2, tp=2, sp=True, vpp=2, m=4, tied=True),
    dict(pp=2, m=3, ddp=True, distopt=True, tied=True),
    dict(pp=2, vpp=2, m=2, ddp=True),
]


@pytest.mark.parametrize("world, cases", [(2, CASES_2), (4, CASES_4)], ids=["pp2", "pp4"])
def test_pipeline_matches_single_process(world, cases):
    results = run_distributed(_train_cases, world, cases, timeout=180)
    for i, case in enumerate(cases):
        per_rank = [results[rank][i] for rank in range(world)]
        _check(case, per_rank)
        _check_schedule(case, per_rank)


def _replicated_grads(_: None) -> dict:
    """Each pp rank holds the same two pipeline-replicated parameters; only some ranks use them."""
    from mg_parallel.pipeline import allreduce_pipeline_replicated_grads

    grid = _grid(1, 2)
    chunk = torch.nn.Module()
    chunk.a = torch.nn.Parameter(torch.zeros(3))
    chunk.b = torch.nn.Parameter(torch.zeros(2, 2))
    chunk.c = torch.nn.Parameter(torch.zeros(1))  # not replicated: left alone
    for p in (chunk.a, chunk.b):
        p.pipeline_replicated = True
    chunk.a.grad = torch.full((3,), 1.0 + grid.pp_rank)  # used by both stages
    if grid.pp_rank == 1:
        chunk.b.grad = torch.ones(2, 2)  # used by the last stage only
    chunk.c.grad = torch.full((1,), 5.0 + grid.pp_rank)
    allreduce_pipeline_replicated_grads([chunk], grid)
    out = {"a": chunk.a.grad.clone(), "b": chunk.b.grad.clone(), "c": chunk.c.grad.clone()}
    lonely = torch.nn.Module()  # a stage that holds fewer replicated elements than its peer: an error, not a hang
    lonely.a = torch.nn.Parameter(torch.zeros(3 if grid.pp_rank == 0 else 4))
    lonely.a.pipeline_replicated = True
    try:
        allreduce_pipeline_replicated_grads([lonely], grid)
    except RuntimeError as e:
        out["error"] = str(e)
    return out


def test_pipeline_replicated_grads_are_summed_over_the_stages():
    results = run_distributed(_replicated_grads, 2, None, timeout=60)
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["a"], torch.full((3,), 3.0))
        torch.testing.assert_close(r["b"], torch.ones(2, 2))
        torch.testing.assert_close(r["c"], torch.full((1,), 5.0 + rank))
        assert "holds 3 pipeline_replicated elements" in r["error"] or "holds 4" in r["error"], r["error"]
