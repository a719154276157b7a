"""GPT training step with mg's fp32 tanh-GeLU (Hugging Face's op order) against torch's fused kernel.

``mg_models.layers.gelu_tanh`` evaluates ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` op by op in
fp32, so converted GPT-2/BERT/T5 v1.1 models give Hugging Face's activations bit for bit; this prints
what that costs a whole training step (forward + backward) against ``F.gelu(x, approximate="tanh")``,
both measured in the same run, interleaved, on one thread.

    .venv/bin/python benchmarks/bench_activation.py [--preset gpt-14m] [--batch 4] [--seq 256] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import mg_models.layers as layers
from mg_models import GPTModel
from mg_models.gpt.presets import get_config
from mg_parallel.grid import ProcessGrid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-14m")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = get_config(args.preset, activation="gelu_tanh")
    model = GPTModel(cfg, ProcessGrid.single(None))
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
    kinds = {"mg gelu_tanh (HF order)": layers.gelu_tanh, "fused F.gelu(tanh)": lambda x: F.gelu(x, approximate="tanh")}

    def step() -> float:
        t0 = time.perf_counter()
        model(ids, labels=ids).float().mean().backward()
        return time.perf_counter() - t0

    step(), step()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in kinds}
    try:
        for _ in range(args.steps):
            for name, fn in kinds.items():
                layers.gelu_tanh = fn
                times[name].append(step())
    finally:
        layers.gelu_tanh = kinds["mg gelu_tanh (HF order)"]
    (a, ta), (b, tb) = times.items()
    print(f"{args.preset} activation=gelu_tanh, {args.batch}x{args.seq} tokens, fp32, 1 thread, {args.steps} steps each")
    for name, ts in times.items():
        print(f"  {name:26s} median {statistics.median(ts):.3f} s  min {min(ts):.3f} s")
    print(f"  ratio {a} / {b}: median {statistics.median(ta) / statistics.median(tb):.3f}, "
          f"min {min(ta) / min(tb):.3f}")


if __name__ == "__main__":
    main()
