"""SFT training throughput: packed conversations vs one conversation per sample, and mg's SFT step vs plain PyTorch.

1. Packing. The same conversations (a long-tailed length mix: lognormal, median ``--median`` tokens, capped
   at the sequence length) are served by ``mg_data.SFTDataset`` with ``packing=best_fit`` and with
   ``packing=none``; one epoch of each is trained (forward, backward and an AdamW step of mg's optimizer on
   a single-process GPTModel, document-masked attention for the packed samples). Reported: conversation
   tokens (not padding) per second, and the ratio packed / unpacked.
2. mg vs plain PyTorch. One padded batch of conversations (labels -100 outside the assistant tokens), the
   same weights: mg's GPTModel + mg's optimizer against the Hugging Face GPT-2 of the same architecture
   with ``torch.optim.AdamW`` (no Trainer), timed step by step, interleaved. Reported: the ratio of step
   times (plain PyTorch / mg, so > 1 means mg is faster).

fp32, one thread, measured in the same run.

    .venv/bin/python benchmarks/bench_sft.py [--preset gpt-14m] [--seq 512] [--conversations 64] [--steps 6]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import torch

from mg_data import ConversationList, SFTDataset, SFTDatasetConfig
from mg_models import GPTModel
from mg_models.gpt.presets import get_config
from mg_models.hf import write_hf_directory
from mg_parallel.distributed import DistributedDataParallel
from mg_parallel.grid import ProcessGrid
from mg_parallel.optimizer import OptimizerConfig, build_optimizer


def conversations(n: int, seq: int, median: int, vocab: int, seed: int = 0) -> ConversationList:
    """``n`` conversations of lognormal lengths (sigma 0.8) in [8, seq + 1], the second half of each in the loss."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median), 0.8, n).astype(int), 8, seq + 1)
    convs = []
    for length in lengths:
        mask = np.zeros(length, np.uint8)
        mask[length // 2:] = 1
        convs.append((rng.integers(3, vocab, length), mask))
    return ConversationList(convs)


def build(preset: str, seq: int) -> tuple[object, object, object]:
    # GPT-2's architecture (biases, tanh GeLU), so the same weights also run as transformers' GPT2LMHeadModel.
    cfg = get_config(preset, max_position_embeddings=seq, add_bias_linear=True, activation="gelu_tanh")
    grid = ProcessGrid.single(None)
    model = DistributedDataParallel(GPTModel(cfg, grid), grid)
    optimizer = build_optimizer([model], grid, OptimizerConfig(lr=1e-4, clip_grad=1.0))
    return cfg, model, optimizer


def mg_step(model: object, optimizer: object, batch: dict[str, torch.Tensor], packed: bool) -> None:
    extra = {"document_ids": batch["document_ids"]} if packed else {}
    per_token = model(batch["tokens"], position_ids=batch["position_ids"], labels=batch["labels"], **extra)
    mask = batch["loss_mask"]
    ((per_token * mask).sum() / mask.sum().clamp(min=1)).backward()
    model.finish_grad_sync()
    optimizer.step()
    optimizer.zero_grad()


def epoch_batches(ds: SFTDataset, batch: int) -> list[dict[str, torch.Tensor]]:
    samples = [ds[i] for i in range(len(ds))]
    out = []
    for i in range(0, len(samples), batch):
        part = samples[i:i + batch]
        out.append({k: torch.from_numpy(np.stack([s[k] for s in part])) for k in part[0]})
    return out


def packing(args: argparse.Namespace) -> None:
    convs = conversations(args.conversations, args.seq, args.median, 512)
    real = int(sum(len(t) - 1 for t, _ in convs.conversations))
    print(f"packing: {args.conversations} conversations, {real} tokens (median length {args.median}, lognormal), "
          f"seq {args.seq}, batch {args.batch}, {args.preset}, fp32, 1 thread")
    results = {}
    for mode in ("best_fit", "none"):
        cfg = SFTDatasetConfig(seq_length=args.seq, packing=mode, shuffle=False)
        ds = SFTDataset(convs, (0, len(convs)), None, cfg)
        batches = epoch_batches(ds, args.batch)
        _, model, optimizer = build(args.preset, args.seq)
        mg_step(model, optimizer, batches[0], mode != "none")  # warm-up
        t0 = time.perf_counter()
        for b in batches:
            mg_step(model, optimizer, b, mode != "none")
        seconds = time.perf_counter() - t0
        results[mode] = real / seconds
        print(f"  packing={mode:8s} {len(ds):4d} samples, {seconds:7.2f} s, {real / seconds:8.0f} conversation "
              f"tokens/s")
    print(f"  ratio packed / unpacked: {results['best_fit'] / results['none']:.2f}")


def versus_pytorch(args: argparse.Namespace) -> None:
    from transformers import GPT2LMHeadModel

    cfg, model, optimizer = build(args.preset, args.seq)
    with tempfile.TemporaryDirectory() as d:
        write_hf_directory(d, model.module.state_dict(), cfg, "gpt2")
        hf = GPT2LMHeadModel.from_pretrained(d, attn_implementation="sdpa").train()
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    convs = conversations(args.batch, args.seq, args.median, cfg.vocab_size, seed=1)
    ds = SFTDataset(convs, (0, len(convs)), None, SFTDatasetConfig(seq_length=args.seq, packing="none",
                                                                    shuffle=False))
    batch = epoch_batches(ds, args.batch)[0]
    labels = batch["labels"].masked_fill(batch["loss_mask"] == 0, -100)
    attention = (batch["document_ids"] >= 0).long()
    # Hugging Face shifts labels inside the model: its inputs' labels are the tokens themselves.
    hf_labels = torch.cat([torch.full_like(labels[:, :1], -100), labels[:, :-1]], dim=1)

    def hf_step() -> None:
        loss = hf(input_ids=batch["tokens"], attention_mask=attention, labels=hf_labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        hf_opt.step()
        hf_opt.zero_grad()

    steps = {"mg": lambda: mg_step(model, optimizer, batch, False), "plain PyTorch (HF GPT-2 + AdamW)": hf_step}
    times: dict[str, list[float]] = {k: [] for k in steps}
    for fn in steps.values():
        fn()  # warm-up
    for _ in range(args.steps):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    print(f"SFT step: {args.batch}x{args.seq} tokens (unpacked, padded), {args.preset}, fp32, 1 thread, "
          f"{args.steps} interleaved steps")
    for name, ts in times.items():
        print(f"  {name:34s} median {statistics.median(ts):.3f} s  min {min(ts):.3f} s")
    (_, mg_t), (_, hf_t) = times.items()
    print(f"  ratio plain PyTorch / mg: median {statistics.median(hf_t) / statistics.median(mg_t):.2f}, "
          f"min {min(hf_t) / min(mg_t):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-14m")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--median", type=int, default=96, help="median conversation length (tokens)")
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    packing(args)
    versus_pytorch(args)


if __name__ == "__main__":
    main()
