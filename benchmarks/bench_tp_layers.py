"""Overhead of the tensor-parallel layers at tp=1 against the plain PyTorch ops.

At tensor-parallel size 1 (no group) ColumnParallelLinear / RowParallelLinear must cost what
nn.Linear costs, VocabParallelEmbedding what nn.Embedding costs, and
vocab_parallel_cross_entropy what F.cross_entropy costs. Each pair is timed forward+backward
in interleaved repetitions (A, B, B, A, ...), so machine load affects both alike, and the
median of the per-repetition ratios is printed, for fp32 and bf16. On the CPU with one thread
the time is this thread's CPU time (robust to other processes); on CUDA it is wall time.

    .venv/bin/python benchmarks/bench_tp_layers.py [--reps 100] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mg_parallel.device import local_device
from mg_parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(step: Callable[[], None], inner: int, device: torch.device) -> float:
    # On the CPU (one intra-op thread; CPU autograd runs in the calling thread) count this
    # thread's CPU time, which time spent descheduled by other processes does not inflate.
    clock = time.thread_time if device.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter
    _sync(device)
    t0 = clock()
    for _ in range(inner):
        step()
    _sync(device)
    return (clock() - t0) / inner


def _compare(name: str, ours: Callable[[], None], ref: Callable[[], None], reps: int, device: torch.device) -> float:
    for _ in range(3):  # warm-up both
        ours()
        ref()
    # Batch short steps so each timed sample lasts >= ~10 ms: timer and scheduler noise shrink.
    inner = max(1, int(0.01 / max(_time(ref, 3, device), 1e-6)))
    ratios, t_ours, t_ref = [], [], []
    for i in range(reps):
        # Alternate which one goes first so neither systematically gets a warmer cache.
        if i % 2:
            a = _time(ours, inner, device)
            b = _time(ref, inner, device)
        else:
            b = _time(ref, inner, device)
            a = _time(ours, inner, device)
        ratios.append(a / b)
        t_ours.append(a)
        t_ref.append(b)
    ratio = statistics.median(ratios)
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    print(
        f"{name:<66} ours {statistics.median(t_ours) * 1e3:8.3f} ms   ref {statistics.median(t_ref) * 1e3:8.3f} ms"
        f"   ratio {ratio:6.3f} (IQR {q1:.3f}-{q3:.3f})"
    )
    return ratio


def _fwd_bwd(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        module.zero_grad(set_to_none=True)
        x.grad = None
        module(x).backward(grad)

    return step


def _run_dtype(dtype: torch.dtype, reps: int, device: torch.device) -> dict[str, float]:
    if device.type == "cpu" and dtype == torch.bfloat16:
        s, b, h, ffn, vocab = 32, 2, 128, 256, 4096  # bf16 matmuls are slow on most CPUs
    else:
        s, b, h, ffn, vocab = 64, 2, 256, 1024, 8192
    ce_vocab = 32768  # a realistic vocabulary: the loss's cost is per token and per vocabulary id
    tag = str(dtype).replace("torch.", "")
    kw = {"dtype": dtype, "device": device}
    results: dict[str, float] = {}
    x = torch.randn(s, b, h, **kw, requires_grad=True)
    g_ffn = torch.randn(s, b, ffn, **kw)
    col, lin = ColumnParallelLinear(h, ffn, **kw), nn.Linear(h, ffn, **kw)
    results[f"ColumnParallelLinear vs nn.Linear {tag}"] = _compare(
        f"ColumnParallelLinear({h}->{ffn}) vs nn.Linear {tag}",
        _fwd_bwd(col, x, g_ffn), _fwd_bwd(lin, x, g_ffn), reps, device,
    )
    lin_b = nn.Linear(h, ffn, **kw)
    noise = _compare(
        f"noise floor: nn.Linear vs an identical nn.Linear {tag}",
        _fwd_bwd(lin_b, x, g_ffn), _fwd_bwd(lin, x, g_ffn), reps, device,
    )
    print(f"{'':<66} (spread of identical work on this machine now: {abs(noise - 1) * 100:.1f}%)")
    x2 = torch.randn(s, b, ffn, **kw, requires_grad=True)
    g_h = torch.randn(s, b, h, **kw)
    row, lin2 = RowParallelLinear(ffn, h, **kw), nn.Linear(ffn, h, **kw)
    results[f"RowParallelLinear vs nn.Linear {tag}"] = _compare(
        f"RowParallelLinear({ffn}->{h}) vs nn.Linear {tag}",
        _fwd_bwd(row, x2, g_h), _fwd_bwd(lin2, x2, g_h), reps, device,
    )
    ids = torch.randint(0, vocab, (s, b), device=device)
    emb, ref_emb = VocabParallelEmbedding(vocab, h, **kw), nn.Embedding(vocab, h, **kw)

    def emb_step(m: nn.Module) -> Callable[[], None]:
        def step() -> None:
            m.zero_grad(set_to_none=True)
            m(ids).backward(g_h)

        return step

    results[f"VocabParallelEmbedding vs nn.Embedding {tag}"] = _compare(
        f"VocabParallelEmbedding({vocab}x{h}) vs nn.Embedding {tag}",
        emb_step(emb), emb_step(ref_emb), reps, device,
    )
    logits = torch.randn(s, b, ce_vocab, **kw, requires_grad=True)
    target = torch.randint(0, ce_vocab, (s, b), device=device)

    def ce_ours() -> None:
        logits.grad = None
        vocab_parallel_cross_entropy(logits, target).sum().backward()

    def ce_ref() -> None:
        logits.grad = None
        F.cross_entropy(logits.view(-1, ce_vocab), target.view(-1), reduction="none").view(s, b).sum().backward()

    results[f"vocab_parallel_cross_entropy vs F.cross_entropy {tag}"] = _compare(
        f"vocab_parallel_cross_entropy(V={ce_vocab}) vs F.cross_entropy {tag}", ce_ours, ce_ref, reps, device
    )
    return results


def run(reps: int, device: torch.device) -> dict[str, float]:
    """Time every pair for fp32 and bf16; returns ``{case: median ratio}``."""
    results: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16):
        results.update(_run_dtype(dtype, reps, device))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=100, help="interleaved repetitions per pair")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: this machine's device)")
    parser.add_argument("--threads", type=int, default=1, help="CPU intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device) if args.device else local_device()
    print(f"tp=1 overhead, forward+backward, median of {args.reps} interleaved repetitions, device={device}")
    results = run(args.reps, device)
    worst = max(results.values())
    print(f"worst ratio {worst:.3f} ({'within' if worst <= 1.05 else 'OVER'} the 5% budget)")


if __name__ == "__main__":
    main()
