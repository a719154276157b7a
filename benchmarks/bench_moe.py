"""MoE layer forward+backward against Hugging Face's Mixtral sparse block, and grouped vs looped experts.

Both layers get the same router and expert weights (Mixtral's ``gate_up_proj [E, 2f, h]`` and
``down_proj [E, h, f]`` transposed into mg's ``[E, h, 2, f]`` / ``[E, f, h]``) and the same tokens;
Mixtral routes by softmax over all experts, top-k and renormalisation, which is mg's
``moe_router_pre_softmax`` with ``moe_router_norm_topk_prob``. The outputs are checked equal
first. Each pair is timed in alternating repetitions (A B, B A, ...) so machine load affects both
alike; the median of the per-repetition ratios is printed. With one thread the time is this
thread's CPU time (robust to other processes on a shared machine).

    .venv/bin/python benchmarks/bench_moe.py [--tokens 2048] [--hidden 512] [--ffn 1024] [--experts 8] [--topk 2]
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


def _compare(name: str, ours: Callable[[], None], ref: Callable[[], None], ref_name: str, reps: int) -> float:
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
    return ratio


def _step(layer: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        (layer(x) * g).sum().backward()

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
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
    if "grouped_mm" in layers:
        _compare("mg MoELayer (grouped_mm)", _step(layers["grouped_mm"], x, g), _step(layers["loop"], x, g),
                 "mg MoELayer (loop)", args.reps)


if __name__ == "__main__":
    main()
