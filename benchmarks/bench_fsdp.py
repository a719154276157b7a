"""Fully sharded data parallelism at dp2: step time against DDP and the distributed optimizer, and the largest
GPT that trains within a memory cap with and without FSDP.

Both parts run mg's own training step on 2 processes x 1 thread (gloo, fp32): a GPT (learned positions,
tied embeddings) wrapped as ``mg train`` wraps it (``DistributedDataParallel``, with or without
``use_distributed_optimizer``, or ``FullyShardedChunk``), ``build_optimizer`` (AdamW, clipping at 1), two
accumulated micro-batches through ``forward_backward_no_pipelining`` and ``optimizer.step()``.

1. Step time: the three wrappers on the same model and batch, interleaved rep by rep (a fresh pair of
   processes for each), each the median of ``--steps`` steps after 2 warm-up steps, as the slowest rank
   saw it. Ratios are to plain DDP. On 2 CPU cores FSDP's all-gathers and reduce-scatters cannot hide
   behind compute, so this is the overhead figure, not a speed-up.
2. Memory cap: per-rank peak resident memory (``ru_maxrss``, what a cgroup memory limit counts) above the
   same process's resident memory before the model is built, over building the model, wrapping it and
   three training steps, with samples short enough (``--mem-seq``) that parameter state, not activations,
   fills the memory, and one micro-batch per step (``--mem-micro``: with more, FSDP holds a whole unsharded
   gradient between micro-batches, since it reduce-scatters only in the last one). Every rank first fixes
   glibc's mmap threshold (``--mmap-threshold``, 64 KiB): by default the threshold rises with each large
   free, after which the layer-sized buffers FSDP gathers and frees stay resident in the heap and the
   resident size no longer follows live memory (with glibc's default FSDP peaks above DDP). Each candidate runs in a fresh pair of processes; the layer count is searched
   (doubling, then bisection) for the largest that stays within ``--cap-mb`` with plain DDP and with FSDP.

    .venv/bin/python benchmarks/bench_fsdp.py [--hidden 256] [--layers 8] [--cap-mb 1200] [--reps 3]
"""

from __future__ import annotations

import argparse
import ctypes
import resource
import statistics
import time

import torch

from mg_parallel.testing import run_distributed, shutdown_pools

VOCAB, N_MICRO = 8192, 2
M_MMAP_THRESHOLD = -3  # mallopt's parameter number
MODES = ("ddp", "distributed optimizer", "fsdp")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def train(mode: str, layers: int, hidden: int, seq: int, micro: int, steps: int, mmap_threshold: int = 0,
          n_micro: int = N_MICRO) -> tuple[list[float], float, int]:
    """(step seconds, peak RSS growth in MB, parameter count) of ``steps`` steps on this rank."""
    if mmap_threshold:
        # glibc serves allocations above its mmap threshold with mmap and unmaps them when freed; the threshold
        # otherwise rises with every large free, after which freed layer-sized buffers stay resident.
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, mmap_threshold)
    from mg_models import GPTConfig, GPTModel
    from mg_parallel.distributed import DistributedDataParallel
    from mg_parallel.grid import ParallelDims, build_grid
    from mg_parallel.optimizer import OptimizerConfig, build_optimizer
    from mg_parallel.pipeline import finalize_model_grads, forward_backward_no_pipelining

    grid = build_grid(ParallelDims())
    base = _rss_mb()
    config = GPTConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=hidden // 64, vocab_size=VOCAB,
                       max_position_embeddings=seq, add_bias_linear=True, tie_word_embeddings=True)
    model = GPTModel(config, grid, seed=0)
    params = sum(p.numel() for p in model.parameters())
    distributed = mode == "distributed optimizer"
    finalize = finalize_model_grads
    if mode == "fsdp":
        from mg_parallel.distributed.fsdp import FullyShardedChunk, finalize_fsdp_grads

        chunk = FullyShardedChunk(model, grid)
        finalize = finalize_fsdp_grads
    else:
        chunk = DistributedDataParallel(model, grid, use_distributed_optimizer=distributed)
    opt = build_optimizer([chunk], grid, OptimizerConfig(lr=1e-4, use_distributed_optimizer=distributed))
    gen = torch.Generator().manual_seed(grid.dp_rank)
    tokens = torch.randint(0, VOCAB, (n_micro, micro, seq + 1), generator=gen)

    def forward_step(batch, m):
        return m(batch[:, :-1], labels=batch[:, 1:]), lambda loss: (loss.mean(), {})

    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        forward_backward_no_pipelining(forward_step, iter(tokens), [chunk], n_micro, grid,
                                       tensor_shape=(seq, micro, hidden), finalize_grads=finalize)
        opt.step()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return times, peak - base, params


def on_fresh_pair(mode: str, layers: int, hidden: int, seq: int, micro: int, steps: int, mmap_threshold: int = 0,
                  n_micro: int = N_MICRO) -> list[tuple[list[float], float, int]]:
    shutdown_pools()  # ru_maxrss is a process's lifetime peak: every measurement gets new processes
    return run_distributed(train, 2, mode, layers, hidden, seq, micro, steps, mmap_threshold, n_micro, threads=1,
                           timeout=3600)


def step_times(args: argparse.Namespace) -> None:
    per_mode: dict[str, list[float]] = {m: [] for m in MODES}
    params = 0
    for rep in range(args.reps):
        order = MODES if rep % 2 == 0 else MODES[::-1]
        for mode in order:
            ranks = on_fresh_pair(mode, args.layers, args.hidden, args.seq, args.micro, args.steps + 2)
            # The step ends when the slowest rank's does: per step, the max over ranks.
            per_step = [max(r[0][i] for r in ranks) for i in range(2, args.steps + 2)]
            per_mode[mode].append(statistics.median(per_step))
            params = ranks[0][2]
        print(f"  rep {rep}: " + ", ".join(f"{m} {per_mode[m][-1] * 1e3:.0f} ms" for m in MODES), flush=True)
    ddp = statistics.median(per_mode["ddp"])
    print(f"step time at dp2 ({params / 1e6:.1f}M parameters: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, "
          f"{N_MICRO} x micro-batch {args.micro} per rank, fp32, median of {args.reps} reps):")
    for m in MODES:
        t = statistics.median(per_mode[m])
        ratios = [a / b for a, b in zip(per_mode[m], per_mode["ddp"])]
        print(f"  {m:22s} {t * 1e3:7.0f} ms/step   {t / ddp:5.2f}x ddp (per rep "
              f"{', '.join(f'{r:.2f}' for r in ratios)})")


def largest_within_cap(mode: str, args: argparse.Namespace) -> tuple[int, float, int]:
    """(layers, peak MB, parameters) of the largest model within the cap."""
    seen: dict[int, tuple[float, int]] = {}

    def fits(layers: int) -> bool:
        ranks = on_fresh_pair(mode, layers, args.mem_hidden, args.mem_seq, 1, 3, args.mmap_threshold, args.mem_micro)
        seen[layers] = (max(r[1] for r in ranks), ranks[0][2])
        ok = seen[layers][0] <= args.cap_mb
        print(f"  {mode}: {layers} layers, {seen[layers][1] / 1e6:.1f}M parameters: peak {seen[layers][0]:.0f} MB "
              f"per rank ({'within' if ok else 'over'} {args.cap_mb} MB)", flush=True)
        return ok

    lo, hi = 0, 1
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    if lo == 0:
        raise SystemExit(f"{mode}: not even one layer fits within {args.cap_mb} MB; raise --cap-mb")
    return lo, *seen[lo]


def memory_cap(args: argparse.Namespace) -> None:
    found = {m: largest_within_cap(m, args) for m in ("ddp", "fsdp")}
    print(f"largest GPT within {args.cap_mb} MB of resident memory per rank at dp2 (hidden {args.mem_hidden}, "
          f"vocab {VOCAB}, {args.mem_micro} x micro-batch 1 of {args.mem_seq} tokens, fp32 AdamW, peak over build + 3 "
          f"steps, glibc mmap threshold {args.mmap_threshold or 'default'}):")
    for m, (layers, peak, params) in found.items():
        print(f"  {m:5s} {layers:3d} layers, {params / 1e6:6.1f}M parameters, peak {peak:.0f} MB")
    ratio = found["fsdp"][2] / found["ddp"][2]
    print(f"  fsdp / ddp parameters: {ratio:.2f}x (target >= 1.8)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256, help="the step-time model's hidden size")
    ap.add_argument("--layers", type=int, default=8, help="the step-time model's layers")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--mem-hidden", type=int, default=512, help="hidden size of the memory-cap models")
    ap.add_argument("--mem-seq", type=int, default=64, help="short samples: the cap is about parameter state")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cap-mb", type=float, default=1200)
    ap.add_argument("--mmap-threshold", type=int, default=65536,
                    help="memory part: fix glibc's mmap threshold at this many bytes in every rank (0: glibc's default)")
    ap.add_argument("--mem-micro", type=int, default=1,
                    help="memory part: micro-batches per step (> 1 accumulates unsharded gradients under FSDP)")
    ap.add_argument("--probe", type=int, default=0, help="only measure both modes at this many layers")
    ap.add_argument("--skip-time", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    args = ap.parse_args()
    if not args.skip_time:
        step_times(args)
    if args.probe:
        for mode in ("ddp", "fsdp"):
            ranks = on_fresh_pair(mode, args.probe, args.mem_hidden, args.mem_seq, 1, 3, args.mmap_threshold,
                                  args.mem_micro)
            print(f"  {mode}: {args.probe} layers, peak {max(r[1] for r in ranks):.0f} MB per rank", flush=True)
    elif not args.skip_memory:
        memory_cap(args)


if __name__ == "__main__":
    main()
