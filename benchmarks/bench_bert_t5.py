"""Training-step throughput of mg's BertModel and T5Model vs Hugging Face's on the same batch (CPU, fp32).

The shapes are ``bert-base`` (hidden 768, 12 heads, vocab 30522) and ``t5-small`` (d_model 512,
8 heads, d_ff 2048, vocab 32128) with a shallow depth so a step fits a small CPU. The mg model
is loaded from the Hugging Face model's own weights (the adapters of ``mg_models.hf``), so both
compute the same loss (checked on the first step). A step is zero_grad + forward + loss +
backward + optimizer step, the same optimizer class and settings on both sides.

The BERT batch is an MLM pretraining batch: the last rows are padded (``attention_mask``, passed
to both models) and 15% of the real tokens carry labels. The row "mg, all-token head" is an
ablation: mg returning logits for every token and ``F.cross_entropy`` on them, as Hugging Face
does, instead of its labelled-positions-only loss path (``lm_labels``). Both mg rows complete the
tied word-embedding gradient in place (one ``[V, h]`` tensor per step instead of three).

Fairness on a shared machine: the same thread count for all (1 by default: on a small machine
loaded by other jobs, a second OpenMP thread that gets descheduled stalls every parallel op, which
makes 2-thread timings swing by 2x between runs); every implementation warms up first; then the
implementations run one step each in turn, rotating which goes first, so load changes hit all
alike; ratios are taken of the best (minimum) step time, which load can only inflate, and the
median is printed alongside.

    .venv/bin/python benchmarks/bench_bert_t5.py [--steps 7] [--layers 2] [--batch 4] [--seq 64]
        [--optimizer adamw-fused|adamw] [--threads 1] [--only bert|t5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import transformers

from mg_models.bert import BertModel
from mg_models.bert import hf as hf_bert
from mg_models.t5 import T5Model
from mg_models.t5 import hf as hf_t5

Impl = tuple[str, torch.nn.Module, Callable[[], torch.Tensor]]


def bert_impls(layers: int, batch: int, seq: int) -> tuple[list[Impl], int]:
    """HF BertForPreTraining, mg BertModel and the all-token-head ablation on one padded MLM batch."""
    cfg = transformers.BertConfig(num_hidden_layers=layers, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    hf = transformers.BertForPreTraining(cfg).train()
    config = hf_bert.config_from_hf(cfg.to_dict())
    state = hf_bert.state_from_hf(hf.state_dict(), config)
    mg, mg_dense = BertModel(config).train(), BertModel(config).train()
    mg.load_state_dict(state)
    mg_dense.load_state_dict(state)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    types = (torch.arange(seq) >= seq // 2).long().expand(batch, seq).contiguous()
    # Rows get shorter by seq/8 each (at least half real), as a length-sorted padded batch.
    lengths = torch.tensor([max(seq // 2, seq - i * (seq // 8)) for i in range(batch)])
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    masked = (torch.rand(batch, seq, generator=gen) < 0.15) & mask.bool()
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    nsp = torch.randint(0, 2, (batch,), generator=gen)

    def hf_loss() -> torch.Tensor:
        return hf(ids, token_type_ids=types, attention_mask=mask, labels=labels, next_sentence_label=nsp).loss

    def mg_loss() -> torch.Tensor:
        lm, binary = mg(ids, types, mask, lm_labels=labels)
        return lm.sum() / (labels != -100).sum() + F.cross_entropy(binary, nsp)

    def mg_dense_loss() -> torch.Tensor:
        logits, binary = mg_dense(ids, types, mask, gather_logits=True)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)) + F.cross_entropy(binary, nsp)

    impls = [("HF", hf, hf_loss), ("mg", mg, mg_loss), ("mg, all-token head", mg_dense, mg_dense_loss)]
    return impls, batch * seq


def t5_impls(layers: int, batch: int, seq: int) -> tuple[list[Impl], int]:
    """HF T5ForConditionalGeneration and mg T5Model on one batch (target length seq/4)."""
    cfg = transformers.T5Config(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_heads=8, num_layers=layers,
                                dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    hf = transformers.T5ForConditionalGeneration(cfg).train()
    config = hf_t5.config_from_hf(cfg.to_dict(), has_lm_head=False)
    mg = T5Model(config).train()
    mg.load_state_dict(hf_t5.state_from_hf(hf.state_dict(), config))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    target = torch.randint(0, cfg.vocab_size, (batch, seq // 4), generator=gen)
    dec = torch.cat([torch.zeros(batch, 1, dtype=torch.long), target[:, :-1]], dim=1)

    def hf_loss() -> torch.Tensor:
        return hf(input_ids=ids, labels=target).loss

    def mg_loss() -> torch.Tensor:
        loss, _ = mg(ids, dec, labels=target)
        return loss.mean()

    return [("HF", hf, hf_loss), ("mg", mg, mg_loss)], batch * (seq + seq // 4)


def make_step(model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor],
              optimizer: str) -> Callable[[], tuple[float, float, float]]:
    """One timed training step -> (wall seconds, process CPU seconds, loss)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=optimizer == "adamw-fused")

    def step() -> tuple[float, float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        opt.step()
        return time.perf_counter() - t0, time.process_time() - c0, loss.item()

    return step


def bench(name: str, impls: list[Impl], tokens: int, steps: int, warmup: int, optimizer: str) -> str:
    """Interleaved timing of ``impls``; returns markdown rows with ratios against the first (HF)."""
    steps_fns = [(label, make_step(model, fn, optimizer)) for label, model, fn in impls]
    first: dict[str, float] = {}
    times: dict[str, list[tuple[float, float]]] = {label: [] for label, _ in steps_fns}
    for i in range(warmup + steps):
        shift = i % len(steps_fns)
        for label, step in steps_fns[shift:] + steps_fns[:shift]:
            wall, cpu, loss = step()
            if i == 0:
                first[label] = loss
            elif i >= warmup:
                times[label].append((wall, cpu))
    best = {k: (min(w for w, _ in v), min(c for _, c in v)) for k, v in times.items()}
    med = {k: statistics.median(w for w, _ in v) for k, v in times.items()}
    ref = steps_fns[0][0]
    rows = []
    for label, _ in steps_fns:
        wall, cpu = best[label]
        rows.append(f"| {name} | {label} | {tokens / wall:.0f} | {best[ref][0] / wall:.2f} | {med[ref] / med[label]:.2f} "
                    f"| {best[ref][1] / cpu:.2f} |")
    diffs = ", ".join(f"{k} {v:.5f}" for k, v in first.items())
    spread = max(abs(v - first[ref]) for v in first.values())
    rows.append(f"first-step loss {diffs} (max |diff| {spread:.1e})")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=7, help="timed steps per implementation")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per implementation first")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--optimizer", choices=("adamw-fused", "adamw"), default="adamw-fused",
                        help="torch.optim.AdamW with fused=True (one kernel per step) or the default loop")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--only", choices=("bert", "t5"), default=None)
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"threads={torch.get_num_threads()} fp32 layers={args.layers} batch={args.batch} seq={args.seq} "
          f"optimizer={args.optimizer} steps={args.steps} after {args.warmup} warm-up, interleaved "
          f"(T5 target length = seq/4; BERT rows padded, 15% of real tokens labelled)")
    print("| model | impl | tokens/s (best) | x HF (wall, best) | x HF (wall, median) | x HF (CPU time, best) |\n"
          "|---|---|---|---|---|---|")
    if args.only in (None, "bert"):
        impls, tokens = bert_impls(args.layers, args.batch, args.seq)
        print(bench(f"bert-base-shaped ({args.layers} layers)", impls, tokens, args.steps, args.warmup,
                    args.optimizer), flush=True)
        del impls
    if args.only in (None, "t5"):
        impls, tokens = t5_impls(args.layers, args.batch, args.seq)
        print(bench(f"t5-small-shaped ({args.layers}+{args.layers} layers)", impls, tokens, args.steps, args.warmup,
                    args.optimizer), flush=True)


if __name__ == "__main__":
    main()
