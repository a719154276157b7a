"""Training-step throughput and MFU of mg's GPTModel vs a plain single-process PyTorch GPT (CPU).

The reference is a nanoGPT-style model written here (``nn.Linear``, SDPA, tied head, fused
AdamW) of the same shape. Both train on the same synthetic batches with ``torch.optim.AdamW``.
Modes:

* ``ref-fp32``: the reference in fp32 (the baseline every ratio is against);
* ``mg-fp32``: GPTModel in fp32;
* ``mg-bf16``: GPTModel with bf16 parameters/activations and fp32 master weights + AdamW state
  (Megatron's mixed precision), loss curve compared with ``mg-fp32`` from the same init and data.

MFU = model FLOPs/s (``mg_models.flops_per_token``) / the fp32 or bf16 matmul peak measured in
this run. Runs are interleaved (ref, mg, bf16, ref, ...) so load changes hit all modes alike.

    .venv/bin/python benchmarks/bench_gpt.py [--steps 2] [--shapes gpt-14m,gpt-30m] [--bf16-micro-batch 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from mg_models import GPTModel, flops_per_token, get_config, num_parameters

SEQ = 256


# ---------------------------------------------------------------- reference (nanoGPT-style)
class RefBlock(nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(h)
        self.c_attn = nn.Linear(h, 3 * h, bias=False)
        self.c_proj = nn.Linear(h, h, bias=False)
        self.ln_2 = nn.LayerNorm(h)
        self.c_fc = nn.Linear(h, 4 * h, bias=False)
        self.mlp_proj = nn.Linear(4 * h, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(h, dim=2)
        q, k, v = (z.view(b, t, self.heads, h // self.heads).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class RefGPT(nn.Module):
    def __init__(self, layers: int, h: int, heads: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, h)
        self.wpe = nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(RefBlock(h, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)
        self.lm_head = nn.Linear(h, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


# ---------------------------------------------------------------- mixed precision for mg
class MasterWeights:
    """bf16 model params with fp32 master copies owning the optimizer (grads copied up, params copied down)."""

    def __init__(self, model: nn.Module, lr: float) -> None:
        self.params = [p for p in model.parameters()]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.opt = torch.optim.AdamW(self.master, lr=lr, fused=True)
        model.to(torch.bfloat16)

    def step(self) -> None:
        for p, m in zip(self.params, self.master):
            m.grad = p.grad.float()
            p.grad = None
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m)


def matmul_peak(dtype: torch.dtype, reps: int = 5) -> float:
    """Best observed GFLOP/s over a few matmul shapes (square and the model's [tokens, h] x [h, 4h]) in dtype."""
    best = 0.0
    for m, k, n in ((1024, 1024, 1024), (2048, 384, 1536), (2048, 1536, 384)):
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        a @ b
        for _ in range(reps):
            t0 = time.perf_counter()
            a @ b
            best = max(best, 2 * m * k * n / (time.perf_counter() - t0) / 1e9)
    return best


def batches(vocab: int, n: int, micro_batch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic Zipf-like token batches (learnable unigram statistics, so the loss falls)."""
    gen = torch.Generator().manual_seed(seed)
    probs = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    out = []
    for _ in range(n):
        toks = torch.multinomial(probs, micro_batch * (SEQ + 1), replacement=True, generator=gen).view(micro_batch, -1)
        out.append((toks[:, :-1].contiguous(), toks[:, 1:].contiguous()))
    return out


def make_runner(mode: str, config, data):
    """Returns step(i) -> (loss, seconds) for one training mode."""
    torch.manual_seed(0)
    if mode == "ref-fp32":
        model = RefGPT(config.num_layers, config.hidden_size, config.num_attention_heads, config.vocab_size, SEQ)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

        def loss_fn(ids, tgt):
            return model(ids, tgt)

        def update():
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        model = GPTModel(config, seed=0)
        if mode == "mg-bf16":
            mp = MasterWeights(model, lr=1e-3)
            update = mp.step
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

            def update():
                opt.step()
                opt.zero_grad(set_to_none=True)

        def loss_fn(ids, tgt):
            return model(ids, labels=tgt).mean()

    def step(i: int) -> tuple[float, float, float]:
        ids, tgt = data[i % len(data)]
        t0, c0 = time.perf_counter(), time.process_time()
        loss = loss_fn(ids, tgt)
        loss.backward()
        update()
        value = loss.item()
        return value, time.perf_counter() - t0, time.process_time() - c0

    return step


def bench_shape(name: str, modes: list[str], steps: int, warmup: int, micro_batch: int) -> dict[str, dict]:
    """Interleaved training steps of each mode on one shape; tokens/s from the median step time."""
    config = get_config(name, max_position_embeddings=SEQ)
    data = batches(config.vocab_size, 4, micro_batch)
    runners = {m: make_runner(m, config, data) for m in modes}
    losses = {m: [] for m in modes}
    times = {m: [] for m in modes}
    cpu = {m: [] for m in modes}
    for i in range(warmup + steps):
        for m in modes:
            loss, dt, ct = runners[m](i)
            losses[m].append(loss)
            if i >= warmup:
                times[m].append(dt)
                cpu[m].append(ct)
    tokens = SEQ * micro_batch
    fpt = flops_per_token(config, SEQ)
    out = {}
    for m in modes:
        # Fastest step: on a shared machine the others are slowed by foreign load, not by the code.
        tps = tokens / min(times[m])
        out[m] = {"tokens_per_s": tps, "gflops": tps * fpt / 1e9, "losses": losses[m],
                  "tokens_per_cpu_s": tokens / statistics.median(cpu[m])}
    out["_meta"] = {"params": num_parameters(config), "flops_per_token": fpt}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--shapes", default="gpt-14m,gpt-30m")
    parser.add_argument("--bf16-shape", default="gpt-14m")
    parser.add_argument("--bf16-micro-batch", type=int, default=8)
    parser.add_argument("--bf16-steps", type=int, default=3, help="steps of the fp32-vs-bf16 loss-curve run")
    args = parser.parse_args()
    peak32, peak16 = matmul_peak(torch.float32), matmul_peak(torch.bfloat16)
    print(f"threads={torch.get_num_threads()} cpu={torch.backends.cpu.get_cpu_capability()}  matmul peak: "
          f"fp32 {peak32:.1f} GFLOP/s, bf16 {peak16:.1f} GFLOP/s (bf16/fp32 = {peak16 / peak32:.2f}x)")
    print(f"seq={SEQ} micro_batch={args.micro_batch} steps={args.steps} (fastest step after {args.warmup} warmup; "
          f"'x ref (CPU time)' uses median process CPU time per step, robust to foreign load)")
    print("\n| shape | params | mode | tokens/s | x ref-fp32 | x ref (CPU time) | MFU (vs fp32 peak) | last loss |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        res = bench_shape(shape, ["ref-fp32", "mg-fp32"], args.steps, args.warmup, args.micro_batch)
        base, base_cpu = res["ref-fp32"]["tokens_per_s"], res["ref-fp32"]["tokens_per_cpu_s"]
        for m in ("ref-fp32", "mg-fp32"):
            r = res[m]
            print(f"| {shape} | {res['_meta']['params'] / 1e6:.1f}M | {m} | {r['tokens_per_s']:.0f} | "
                  f"{r['tokens_per_s'] / base:.2f} | {r['tokens_per_cpu_s'] / base_cpu:.2f} | "
                  f"{100 * r['gflops'] / peak32:.0f}% | {r['losses'][-1]:.3f} |")

    # bf16: same init and data as fp32; the loss curves must agree and the speed-up is recorded.
    mb = args.bf16_micro_batch
    res = bench_shape(args.bf16_shape, ["ref-fp32", "mg-fp32", "mg-bf16"], args.bf16_steps, 0, mb)
    base = res["ref-fp32"]["tokens_per_s"]
    print(f"\nbf16 ({args.bf16_shape}, micro_batch={mb}, {args.bf16_steps} steps, no warmup):")
    print("| mode | tokens/s | x ref-fp32 | MFU (vs own-dtype peak) |")
    print("|---|---|---|---|")
    for m in ("ref-fp32", "mg-fp32", "mg-bf16"):
        r = res[m]
        peak = peak16 if m.endswith("bf16") else peak32
        print(f"| {m} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base:.2f} | {100 * r['gflops'] / peak:.0f}% |")
    diff = max(abs(a - b) for a, b in zip(res["mg-bf16"]["losses"], res["mg-fp32"]["losses"]))
    curve = " ".join(f"{a:.4f}/{b:.4f}" for a, b in zip(res["mg-fp32"]["losses"], res["mg-bf16"]["losses"]))
    print(f"loss per step fp32/bf16: {curve}; max |diff| = {diff:.4f} (tolerance 0.05)")


if __name__ == "__main__":
    main()
