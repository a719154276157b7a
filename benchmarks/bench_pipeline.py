"""Pipeline bubble: time per iteration of 1F1B and interleaved 1F1B at pp=4, against the ideal.

Each stage's forward costs a fixed small torch op plus ``time.sleep(F)`` and its backward
``time.sleep(2F)``: the machine this runs on has 2 cores shared by 4 ranks (and by other jobs),
so compute-bound stages would measure the CPU scheduler, not the pipeline. With sleep-dominated
stages the measurement reflects the schedule's structure (warm-up, steady state, cool-down, and
the cost of point-to-point exchange over gloo), which is what the bubble is.

Reference, measured in the same run: the whole model (4 stages' worth of sleep) in one process
with no pipelining, T1. The ideal pp=4 time is T1 / 4; the bubble fraction is
``T_pp / (T1 / 4) - 1``, compared with the analytic ``(p - 1) / (v * m)``.

Run from the repository root::

    .venv/bin/python benchmarks/bench_pipeline.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from mg_parallel import ParallelDims, ProcessGrid, build_grid
from mg_parallel.pipeline import ScheduleRecorder, get_forward_backward_func
from mg_parallel.testing import run_distributed

SHAPE = (8, 2, 16)  # [seq, micro_batch, hidden]
PP = 4


class _Sleep(torch.autograd.Function):
    """Identity whose forward sleeps ``fwd`` seconds and backward ``bwd`` seconds."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fwd: float, bwd: float) -> torch.Tensor:
        time.sleep(fwd)
        ctx.bwd = bwd
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.bwd)
        return grad, None, None


class SleepStage(nn.Module):
    """A stage whose cost is one small Linear plus a controlled sleep (backward twice forward)."""

    def __init__(self, seconds: float, first: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(SHAPE[-1], SHAPE[-1])
        self.seconds, self.first = seconds, first
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        self.input_tensor = tensor

    def forward(self, batch: torch.Tensor | None) -> torch.Tensor:
        x = batch if self.first else self.input_tensor
        return _Sleep.apply(self.linear(x), self.seconds, 2 * self.seconds)


def forward_step(batch, model):
    return model(batch), lambda out: (out.pow(2).mean(), {})


def _batches(m: int):
    return iter([torch.randn(SHAPE) for _ in range(m)])


_GRID: dict = {}


def bench_worker(vpp: int, m: int, stage_seconds: float, iters: int) -> dict:
    """On every rank: time ``iters`` iterations (after one warm-up); events of the last one."""
    torch.set_num_threads(1)
    if "pp" not in _GRID:
        _GRID["pp"] = build_grid(ParallelDims(pp=PP))
    grid = _GRID["pp"]
    torch.manual_seed(grid.rank)
    chunks = [SleepStage(stage_seconds / vpp, first=grid.is_first_stage and c == 0) for c in range(vpp)]
    schedule = get_forward_backward_func(grid, vpp if vpp > 1 else None)
    times, recorder = [], ScheduleRecorder()
    for i in range(iters + 1):
        dist.barrier()
        t0 = time.time()
        schedule(forward_step, _batches(m), chunks, m, grid, tensor_shape=SHAPE,
                 recorder=recorder if i == iters else None)
        times.append(time.time() - t0)
    return {"times": times[1:], "events": recorder.events}


def reference_time(m: int, stage_seconds: float, iters: int) -> float:
    """Median seconds per iteration of the whole model (PP stages of sleep) in one process."""
    torch.set_num_threads(1)
    model = SleepStage(PP * stage_seconds, first=True)
    grid = ProcessGrid.single()
    schedule = get_forward_backward_func(grid)
    times = []
    for _ in range(iters + 1):
        t0 = time.time()
        schedule(forward_step, _batches(m), [model], m, grid)
        times.append(time.time() - t0)
    return statistics.median(times[1:])


def pipeline_time(vpp: int, m: int, stage_seconds: float, iters: int) -> tuple[float, list]:
    """Median over iterations of the slowest rank's time, and all ranks' events of the last iteration."""
    results = run_distributed(bench_worker, PP, vpp, m, stage_seconds, iters, timeout=600)
    per_iter = [max(r["times"][i] for r in results) for i in range(iters)]
    return statistics.median(per_iter), [e for r in results for e in r["events"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage-ms", type=float, default=50.0, help="forward sleep per stage (backward is 2x)")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    args = parser.parse_args()
    f = args.stage_ms / 1000
    print(f"pp={PP}, per-stage forward {args.stage_ms:.0f} ms + backward {2 * args.stage_ms:.0f} ms (sleep), "
          f"median of {args.iters} iterations\n")
    print("| schedule | m | T1 (pp=1) s | T (pp=4) s | ideal T1/4 s | T / ideal | bubble measured | bubble (p-1)/(v·m) |")
    print("|---|---|---|---|---|---|---|---|")
    for m in args.microbatches:
        t1 = reference_time(m, f, args.iters)
        for name, vpp in (("1F1B", 1), ("interleaved v=2", 2)):
            t, _ = pipeline_time(vpp, m, f, args.iters)
            ideal = t1 / PP
            analytic = (PP - 1) / (vpp * m)
            print(f"| {name} | {m} | {t1:.3f} | {t:.3f} | {ideal:.3f} | {t / ideal:.3f} | {t / ideal - 1:.3f} | "
                  f"{analytic:.3f} |", flush=True)


if __name__ == "__main__":
    main()
