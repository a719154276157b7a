"""Context-parallel attention: ring attention at cp=2 against one process, and bytes exchanged.

1. Time: causal attention forward+backward over ``--seq`` tokens, as ring attention (``cp_comm``
   p2p) on 2 processes x 1 thread against 1 process x 2 threads running the same attention on the
   whole sequence (``context_parallel_attention(group=None)``: SDPA, i.e. the same CPU flash kernel).
   The two are interleaved rep by rep; efficiency = t(1 process, 2 threads) / t(cp=2) (wall time of
   the slowest rank), median of the per-rep ratios (1.0 = perfect scaling; the causal layout gives
   every rank the same work). The CPU-time ratio (CPU seconds of the one process / CPU seconds of
   both ranks together) is steadier on a shared machine; it misses time spent waiting.
   ``--comms`` adds the other kinds to the timing.
2. Bytes: every kind's forward+backward at cp=2 and cp=4 with the communication calls wrapped to
   count the bytes each rank receives, against the analytic figure per attention layer.

    .venv/bin/python benchmarks/bench_context_parallel.py [--seq 8192] [--heads 4] [--head-dim 64] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from mg_parallel import collectives
from mg_parallel.context_parallel import block_attention_impl, context_parallel_attention, split_for_cp
from mg_parallel.grid import ParallelDims, build_grid
from mg_parallel.testing import run_distributed, shutdown_pools


def _inputs(seq: int, heads: int, kv_heads: int, head_dim: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, seq, head_dim, generator=gen)
    k, v = torch.randn(2, 1, kv_heads, seq, head_dim, generator=gen)
    return [q, k, v]


def _fwd_bwd(qkv: list[torch.Tensor], group: dist.ProcessGroup | None, comm: str) -> None:
    leaves = [t.detach().requires_grad_(True) for t in qkv]
    out = context_parallel_attention(*leaves, group=group, comm=comm, causal=True)
    out.backward(torch.ones_like(out))


def time_attention(cp: int, comm: str, seq: int, heads: int, head_dim: int, inner: int) -> tuple[float, float]:
    """(wall, CPU) seconds per forward+backward on this rank; CPU time counts all its threads."""
    grid = build_grid(ParallelDims(cp=cp))
    qkv = [split_for_cp(t, grid.cp_rank, cp, seq_dim=2) for t in _inputs(seq, heads, heads, head_dim)]
    _fwd_bwd(qkv, grid.cp_group, comm)  # warm-up
    if cp > 1:
        dist.barrier(group=grid.cp_group)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(inner):
        _fwd_bwd(qkv, grid.cp_group, comm)
    if cp > 1:
        dist.barrier(group=grid.cp_group)
    return (time.perf_counter() - t0) / inner, (time.process_time() - c0) / inner


def count_bytes(cp: int, comm: str, seq: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """Bytes this rank receives from the others during one forward+backward."""
    received = [0]

    def wrap(module, name, count):  # noqa: ANN001, ANN202
        real = getattr(module, name)

        def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            received[0] += count(*args)
            return real(*args, **kwargs)

        setattr(module, name, counted)
        return real

    def p2p(ops):  # noqa: ANN001, ANN202
        return sum(op.tensor.nbytes for op in ops if op.op is dist.irecv)

    patches = [
        (dist, "batch_isend_irecv", wrap(dist, "batch_isend_irecv", p2p)),
        (dist, "all_to_all_single", wrap(dist, "all_to_all_single", lambda out, inp: out.nbytes * (cp - 1) // cp)),
        (collectives, "all_gather_into_tensor",
         wrap(collectives, "all_gather_into_tensor", lambda out, inp: out.nbytes - inp.nbytes)),
        (collectives, "reduce_scatter_tensor",
         wrap(collectives, "reduce_scatter_tensor", lambda out, inp: out.nbytes * (cp - 1))),
    ]
    try:
        grid = build_grid(ParallelDims(cp=cp))
        qkv = [split_for_cp(t, grid.cp_rank, cp, seq_dim=2) for t in _inputs(seq, heads, kv_heads, head_dim)]
        _fwd_bwd(qkv, grid.cp_group, comm)
    finally:
        for module, name, real in patches:
            setattr(module, name, real)
    return received[0]


def analytic_bytes(comm: str, cp: int, seq: int, heads: int, kv_heads: int, head_dim: int, elem: int = 4) -> int:
    """Bytes one rank receives per attention layer (forward + backward), from the algorithm."""
    q = heads * (seq // cp) * head_dim * elem  # this rank's Q (or O, dO, dQ)
    kv = kv_heads * (seq // cp) * head_dim * elem  # this rank's K (or V)
    if comm == "p2p":  # K,V: cp-1 hops forward, cp-1 backward; fp32 dK,dV: cp hops
        return 4 * (cp - 1) * kv + 2 * cp * kv_heads * (seq // cp) * head_dim * 4
    if comm == "allgather":  # K,V gathered forward and again backward, fp32 dK,dV reduce-scattered backward
        return 4 * (cp - 1) * kv + 2 * (cp - 1) * kv_heads * (seq // cp) * head_dim * 4
    # a2a: q, k, v, out forward and dout, dq, dk, dv backward, each keeping 1/cp at home
    return 2 * (cp - 1) * (2 * q + 2 * kv) // cp


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--inner", type=int, default=1, help="forward+backward passes per timed sample")
    p.add_argument("--comms", nargs="+", default=["p2p"], choices=["p2p", "allgather", "a2a"])
    p.add_argument("--bytes-seq", type=int, default=1024, help="sequence length of the byte count")
    a = p.parse_args()
    print(f"torch {torch.__version__}; causal attention b=1 heads={a.heads} head_dim={a.head_dim} seq={a.seq} "
          f"fp32, forward+backward; per-block kernel: {block_attention_impl('cpu', torch.float32)}")
    args = (a.seq, a.heads, a.head_dim, a.inner)
    ratios: dict[str, list[float]] = {c: [] for c in a.comms}
    cpu_ratios: dict[str, list[float]] = {c: [] for c in a.comms}
    times: dict[str, list[float]] = {c: [] for c in ["1proc"] + a.comms}
    run_distributed(time_attention, 1, 1, "p2p", 64, 1, 8, 1, threads=2)  # start both pools before timing
    run_distributed(time_attention, 2, 2, "p2p", 64, 1, 8, 1, threads=1)
    for rep in range(a.reps):
        t1, c1 = run_distributed(time_attention, 1, 1, "p2p", *args, threads=2, timeout=1800)[0]
        times["1proc"].append(t1)
        for comm in a.comms:
            ranks = run_distributed(time_attention, 2, 2, comm, *args, threads=1, timeout=1800)
            t2 = max(t for t, _ in ranks)
            times[comm].append(t2)
            ratios[comm].append(t1 / t2)
            cpu_ratios[comm].append(c1 / sum(c for _, c in ranks))
        print(f"rep {rep}: 1 process x 2 threads {t1:.2f} s | "
              + " | ".join(f"cp=2 {c} {times[c][-1]:.2f} s" for c in a.comms), flush=True)
    for comm in a.comms:
        print(f"cp=2 {comm} (2 processes x 1 thread): median {statistics.median(times[comm]):.2f} s vs 1 process x "
              f"2 threads {statistics.median(times['1proc']):.2f} s: efficiency {statistics.median(ratios[comm]):.2f} "
              f"(CPU-time ratio {statistics.median(cpu_ratios[comm]):.2f})")

    for cp in (2, 4):
        for heads, kv_heads in ((a.heads, a.heads), (2 * a.heads, a.heads)):  # MHA, GQA
            for comm in ("p2p", "allgather", "a2a"):
                got = run_distributed(count_bytes, cp, cp, comm, a.bytes_seq, heads, kv_heads, a.head_dim)
                want = analytic_bytes(comm, cp, a.bytes_seq, heads, kv_heads, a.head_dim)
                print(f"bytes per rank per layer, cp={cp} {comm:9s} seq={a.bytes_seq} heads={heads} kv_heads={kv_heads}: "
                      f"measured {max(got) / 2**20:.3f} MiB, analytic {want / 2**20:.3f} MiB "
                      f"({'equal' if set(got) == {want} else 'DIFFERENT: ' + str(got)})")
    shutdown_pools()


if __name__ == "__main__":  # workers are spawned: they import this module without running main()
    main()
