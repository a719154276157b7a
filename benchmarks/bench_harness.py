"""Cost of the multi-process test harness: pool start-up per world size and the per-call overhead.

Run from the repository root:  .venv/bin/python benchmarks/bench_harness.py
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from mg_parallel.testing import run_distributed, shutdown_pools


def all_reduce_one() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def main() -> None:
    t0 = time.perf_counter()
    torch.ones(1)
    print(f"this process: torch imported; measuring with {torch.__version__}")
    for ws in (1, 2, 4):
        t0 = time.perf_counter()
        assert run_distributed(all_reduce_one, ws) == [float(ws)] * ws
        start = time.perf_counter() - t0
        t1 = time.perf_counter()
        calls = 20
        for _ in range(calls):
            run_distributed(all_reduce_one, ws)
        per_call = (time.perf_counter() - t1) / calls
        print(f"world {ws}: pool start-up {start:.2f} s (once per world size per test session), "
              f"later calls {per_call * 1000:.1f} ms each")
    shutdown_pools()


if __name__ == "__main__":  # workers are spawned: they import this module without running main()
    main()
