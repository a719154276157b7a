"""MoE layer forward+backward against Hugging Face's Mixtral sparse block, and grouped vs looped experts.

Both layers get the same router and expert weights (Mixtral's ``gate_up_proj [E, 2f, h]`` and
``down_proj [E, h, f]`` transposed into mg's ``[E, h, 2, f]`` / ``[E, f, h]``) and the same tokens;
Mixtral routes by softmax over all experts, top-k and renormalisation, which is mg's
``moe_router_pre_softmax`` with ``moe_router_norm_topk_prob``. The outputs are checked equal
first. Each pair is timed in alternating repetitions (A B, B A, ...) so machine load affects both
alike; the median of the per-repetition ratios is printed. With one thread the time is this
thread's CPU time (robust to other processes on a shared machine).

    .venv/bin/python benchmarks/bench_moe.py [--tokens 2048] [--hidden 512] [--ffn 1024] [--experts 8] [--topk 2]

The products alone bound any implementation: the "floor" times the six matmuls per expert (forward and
backward) and nothing else, and the last lines give this machine's fp32 matmul peak (the best single
contiguous product) and what the floor and Hugging Face's block reach as a share of it.

``--bytes``: all-to-all traffic of one MoE layer's forward+backward at ep 2 and 4 (``ep`` processes, the
dispatcher's ``all_to_all_single`` calls wrapped to count what each rank sends to the others), per token,
against the analytic ``2·k·h·bytes`` per direction (dispatch and combine each move every token's ``k``
rows once; backward mirrors forward) times the share of choices that leave the rank: ``(ep-1)/ep`` for
even routing, and the share the router really sent.

``--gpt``: training-step tokens/s of a small MoE GPT against the dense GPT with the same active parameters
(its FFN is ``k`` experts wide), one process, fp32, and the operators that take the time in each
(``torch.profiler``, self CPU time).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

from mg_parallel.moe import MoEConfig, MoELayer, grouped_mm_supported


def _time(step: Callable[[], None], inner: int) -> float:
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    t0 = clock()
    for _ in range(inner):
        step()
    return (clock() - t0) / inner


def _compare(name: str, ours: Callable[[], None], ref: Callable[[], None], ref_name: str, reps: int
             ) -> tuple[float, float, float]:
    """Print and return ``(median ratio ref/ours, median time of ours, median time of ref)``."""
    for _ in range(2):
        ours()
        ref()
    inner = max(1, int(0.2 / max(_time(ref, 1), 1e-6)))
    ratios, t_ours, t_ref = [], [], []
    for i in range(reps):
        pair = (ours, ref) if i % 2 else (ref, ours)
        a, b = (_time(f, inner) for f in pair)
        o, r = (a, b) if i % 2 else (b, a)
        t_ours.append(o)
        t_ref.append(r)
        ratios.append(r / o)
    ratio = statistics.median(ratios)
    print(f"  {name:34s} {statistics.median(t_ours) * 1e3:8.2f} ms   {ref_name:26s} "
          f"{statistics.median(t_ref) * 1e3:8.2f} ms   ratio {ratio:5.2f}x")
    return ratio, statistics.median(t_ours), statistics.median(t_ref)


def _matmul_peak(rows: int, h: int, f: int, reps: int) -> float:
    """This machine's fp32 matmul rate (FLOP/s): the best of ``reps`` timings of the layer's largest product done
    as one contiguous matmul (every routed row through one ``h x 2f`` weight), and of a square 2048 product."""
    best = 0.0
    for m, n, k in ((rows, 2 * f, h), (2048, 2048, 2048)):
        a, b = torch.randn(m, k), torch.randn(k, n)

        def product(a: torch.Tensor = a, b: torch.Tensor = b) -> None:
            a @ b

        product()
        inner = max(1, int(0.2 / max(_time(product, 1), 1e-6)))
        best = max(best, max(2 * m * n * k / _time(product, inner) for _ in range(reps)))
    return best


def _step(layer: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        (layer(x) * g).sum().backward()

    return step


def _matmul_floor(counts: list[int], h: int, f: int) -> Callable[[], None]:
    """The matmuls of a SwiGLU MoE layer's forward+backward and nothing else, on contiguous tensors with the routed
    row counts of each expert: ``x @ w1``, ``a @ w2`` forward, then both projections' input and weight gradients.
    Any implementation that computes these products takes at least this long."""
    mats = []
    for m in counts:
        x, a, g2, g1 = torch.randn(m, h), torch.randn(m, f), torch.randn(m, h), torch.randn(m, 2 * f)
        mats.append((x, torch.randn(h, 2 * f), a, torch.randn(f, h), g2, g1))

    def step() -> None:
        for x, w1, a, w2, g2, g1 in mats:
            x @ w1, a @ w2, g2 @ w2.t(), a.t() @ g2, g1 @ w1.t(), x.t() @ g1

    return step


def _count_bytes(ep: int, tokens: int, h: int, f: int, n: int, k: int) -> dict[str, float]:
    """On one of ``ep`` ranks: bytes this rank sends to other ranks in forward and backward, and the share of
    its (token, expert) choices whose expert lives elsewhere."""
    import torch.distributed as dist

    from mg_parallel.grid import ParallelDims, build_grid
    from mg_parallel.moe import comm

    grid = build_grid(ParallelDims(ep=ep))
    sent = {"forward": 0, "backward": 0}
    original = comm._a2a

    def counting(x, group, out_splits, in_splits):
        rows = sum(in_splits) - in_splits[dist.get_rank(group)]  # rows that leave this rank
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        sent[phase] += rows * x[0].numel() * x.element_size() if x.shape[0] else 0
        return original(x, group, out_splits, in_splits)

    comm._a2a = counting
    try:
        torch.manual_seed(0)  # the same router on every rank
        layer = MoELayer(h, f, n, MoEConfig(moe_router_topk=k, moe_router_load_balancing_type="none"), grid)
        gen = torch.Generator().manual_seed(1 + grid.rank)
        x = torch.randn(tokens, h, generator=gen, requires_grad=True)
        layer(x).sum().backward()
        indices = torch.topk(x.detach() @ layer.router.weight.detach().T, k, dim=-1).indices
        away = (indices // (n // ep) != grid.ep_rank).float().mean().item()
    finally:
        comm._a2a = original
    return {**{p: b / tokens for p, b in sent.items()}, "away": away}


def bench_bytes(args: argparse.Namespace) -> None:
    from mg_parallel.testing import run_distributed

    h, f, n, k = args.hidden, args.ffn, args.experts, args.topk
    print(f"all-to-all bytes per token per MoE layer (h={h}, top-{k}, {n} experts, fp32, {args.tokens} tokens per "
          f"rank); analytic 2·k·h·4 = {2 * k * h * 4} bytes per direction before the share that leaves the rank:")
    for ep in (2, 4):
        ranks = run_distributed(_count_bytes, ep, ep, args.tokens, h, f, n, k, timeout=600)
        for phase in ("forward", "backward"):
            measured = statistics.mean(r[phase] for r in ranks)
            away = statistics.mean(r["away"] for r in ranks)
            exact, even = 2 * k * h * 4 * away, 2 * k * h * 4 * (ep - 1) / ep
            print(f"  ep{ep} {phase:8s}: {measured:8.1f} B/token; analytic x routed share {away:.3f} = {exact:8.1f} "
                  f"(ratio {measured / exact:.4f}); x even share {(ep - 1) / ep:.3f} = {even:8.1f}")


def bench_gpt(args: argparse.Namespace) -> None:
    from mg_models import GPTConfig, GPTModel

    common = dict(num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=4096, max_position_embeddings=256,
                  position_embedding="rope", normalization="rmsnorm", activation="swiglu", add_bias_linear=False)
    f, n, k = 256, 8, 2
    models = {
        f"MoE ({n} experts of {f}, top-{k})": GPTConfig(**common, ffn_hidden_size=k * f, num_experts=n,
                                                         moe_ffn_hidden_size=f, moe_router_topk=k,
                                                         moe_aux_loss_coeff=1e-2),
        f"dense (FFN {k * f}, the same active parameters)": GPTConfig(**common, ffn_hidden_size=k * f),
    }
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 4096, (4, 257), generator=gen)
    steps = {}
    for name, cfg in models.items():
        torch.manual_seed(0)
        model = GPTModel(cfg, seed=0)

        def step(model=model) -> None:
            model.zero_grad(set_to_none=True)
            model(batch[:, :-1], labels=batch[:, 1:]).mean().backward()

        steps[name] = step
    (moe_name, moe_step), (dense_name, dense_step) = steps.items()
    print(f"GPT training step (4 layers, h=256, 4 x 256 tokens, fp32, {args.threads} thread(s)):")
    ratio, _, _ = _compare(moe_name, moe_step, dense_step, dense_name, args.reps)
    print(f"  MoE tokens/s = {ratio:.2f} x the dense model's")
    from torch.profiler import ProfilerActivity, profile

    for name, step in steps.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                step()
        events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in events)
        top = ", ".join(f"{e.key} {e.self_cpu_time_total / total:.0%}" for e in events[:8])
        print(f"  {name}: self CPU time by operator: {top}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bytes", action="store_true", help="only the all-to-all bytes at ep 2 and 4")
    ap.add_argument("--gpt", action="store_true", help="only the MoE GPT vs the dense GPT")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.bytes:
        return bench_bytes(args)
    if args.gpt:
        return bench_gpt(args)
    h, f, n, k = args.hidden, args.ffn, args.experts, args.topk

    hf = MixtralSparseMoeBlock(MixtralConfig(hidden_size=h, intermediate_size=f, num_local_experts=n,
                                             num_experts_per_tok=k, router_jitter_noise=0.0))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(std=0.02)
    gate_up, down = hf.experts.gate_up_proj.detach(), hf.experts.down_proj.detach()
    w1 = gate_up.view(n, 2, f, h).permute(0, 3, 1, 2).contiguous()  # [E, h, 2, f]
    w2 = down.transpose(1, 2).contiguous()  # [E, f, h]
    layers = {}
    for grouped in ((True,) if grouped_mm_supported(h, 2 * f, torch.float32, torch.device("cpu")) else ()) + (False,):
        cfg = MoEConfig(moe_router_topk=k, moe_router_pre_softmax=True, moe_router_norm_topk_prob=True,
                        moe_router_load_balancing_type="none", moe_grouped_gemm=grouped)
        layer = MoELayer(h, f, n, cfg, init_method=lambda w: w.copy_(w1 if w.dim() == 4 else w2))
        with torch.no_grad():
            layer.router.weight.copy_(hf.gate.weight)
        layers[layer.path] = layer

    x = torch.randn(args.tokens // 4, 4, h, requires_grad=True)  # [s, b, h]
    g = torch.randn_like(x)
    ref_out = hf(x.transpose(0, 1).contiguous()).transpose(0, 1)  # Mixtral takes [b, s, h]
    for name, layer in layers.items():
        diff = ((layer(x) - ref_out).abs().max() / ref_out.abs().max()).item()
        print(f"mg {name} vs Mixtral: max |output difference| / max |output| = {diff:.2e}")
        assert diff < 1e-5, diff

    class HFSeqFirst(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = hf

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return self.block(t.transpose(0, 1).contiguous()).transpose(0, 1)

    ref = HFSeqFirst()
    print(f"MoE forward+backward, CPU fp32, {args.threads} thread(s): {args.tokens} tokens, h={h}, f={f}, "
          f"{n} experts, top-{k}, SwiGLU, median of {args.reps} alternated repetitions")
    for name, layer in layers.items():
        _compare(f"mg MoELayer ({name})", _step(layer, x, g), _step(ref, x, g), "HF MixtralSparseMoeBlock", args.reps)
    with torch.no_grad():
        choices = torch.softmax(x.reshape(-1, h) @ hf.gate.weight.t(), -1).topk(k, -1).indices
    counts = torch.bincount(choices.flatten(), minlength=n).tolist()
    floor = _matmul_floor(counts, h, f)
    bound, t_floor, t_hf = _compare("the matmuls alone (a floor)", floor, _step(ref, x, g), "HF MixtralSparseMoeBlock",
                                    args.reps)
    print(f"  => no implementation of these products can be more than {bound:.2f}x Hugging Face here")
    for name, layer in layers.items():
        _compare("the matmuls alone (a floor)", floor, _step(layer, x, g), f"mg MoELayer ({name})", args.reps)
    # The products' FLOPs: forward x@w1 (2·m·h·2f) and a@w2 (2·m·f·h), backward twice that: 18·m·h·f per expert.
    flop = sum(18 * m * h * f for m in counts)
    peak = _matmul_peak(sum(counts), h, f, args.reps)
    print(f"  the products: {flop / 1e9:.1f} GFLOP per step; this machine's fp32 matmul peak (best single contiguous "
          f"matmul) {peak / 1e9:.1f} GFLOP/s")
    print(f"  the floor runs them at {flop / t_floor / 1e9:.1f} GFLOP/s ({flop / t_floor / peak:.2f} of the peak), "
          f"Hugging Face's block at {flop / t_hf / 1e9:.1f} GFLOP/s ({flop / t_hf / peak:.2f})")
    print(f"  => at the peak, with nothing but the products, a layer would be {peak * t_hf / flop:.2f}x Hugging Face")
    if "grouped_mm" in layers:
        _compare("mg MoELayer (grouped_mm)", _step(layers["grouped_mm"], x, g), _step(layers["loop"], x, g),
                 "mg MoELayer (loop)", args.reps)


if __name__ == "__main__":
    main()
