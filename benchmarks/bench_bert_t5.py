"""Training-step throughput of mg's BertModel and T5Model vs Hugging Face's on the same batch (CPU, fp32).

The shapes are ``bert-base`` (hidden 768, 12 heads, vocab 30522) and ``t5-small`` (d_model 512,
8 heads, d_ff 2048, vocab 32128) with a shallow depth so a step fits a small CPU. The mg model
is loaded from the Hugging Face model's own weights (the adapters of ``mg_models.hf``), so both
compute the same loss (checked on the first step). A step is forward + loss + backward +
``torch.optim.AdamW``. Steps alternate between the two models so load changes hit both alike;
the reported figure is the median step time after one warm-up step.

    .venv/bin/python benchmarks/bench_bert_t5.py [--steps 3] [--layers 2] [--batch 3] [--seq 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
import transformers

from mg_models.bert import BertModel
from mg_models.hf import bert as hf_bert
from mg_models.hf import t5 as hf_t5
from mg_models.t5 import T5Model


def bert_pair(layers: int, batch: int, seq: int):
    cfg = transformers.BertConfig(num_hidden_layers=layers, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    hf = transformers.BertForPreTraining(cfg).train()
    config = hf_bert.config_from_hf(cfg.to_dict())
    mg = BertModel(config).train()
    mg.load_state_dict(hf_bert.state_from_hf(hf.state_dict(), config))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    types = (torch.arange(seq) >= seq // 2).long().expand(batch, seq).contiguous()
    labels = torch.where(torch.rand(batch, seq, generator=gen) < 0.15, ids, torch.full_like(ids, -100))
    nsp = torch.randint(0, 2, (batch,), generator=gen)

    def hf_loss() -> torch.Tensor:
        return hf(ids, token_type_ids=types, labels=labels, next_sentence_label=nsp).loss

    def mg_loss() -> torch.Tensor:
        lm, binary = mg(ids, types, lm_labels=labels)
        return lm.sum() / (labels != -100).sum() + F.cross_entropy(binary, nsp)

    return hf, hf_loss, mg, mg_loss, batch * seq


def t5_pair(layers: int, batch: int, seq: int):
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

    return hf, hf_loss, mg, mg_loss, batch * (seq + seq // 4)


def bench(name: str, pair, steps: int) -> str:
    hf, hf_loss, mg, mg_loss, tokens = pair
    runners = {}
    for label, model, loss_fn in (("HF", hf, hf_loss), ("mg", mg, mg_loss)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, loss_fn=loss_fn, opt=opt) -> tuple[float, float, float]:
            t0, c0 = time.perf_counter(), time.process_time()
            opt.zero_grad(set_to_none=True)
            loss = loss_fn()
            loss.backward()
            opt.step()
            return time.perf_counter() - t0, time.process_time() - c0, loss.item()

        runners[label] = step
    times: dict[str, list[tuple[float, float]]] = {"HF": [], "mg": []}
    first: dict[str, float] = {}
    for i in range(steps + 1):
        for label, step in runners.items():
            wall, cpu, loss = step()
            if i == 0:
                first[label] = loss
            else:
                times[label].append((wall, cpu))
    rows = []
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
    for label in ("HF", "mg"):
        wall, cpu = med[label]
        rows.append(f"| {name} | {label} | {tokens / wall:.0f} | {med['HF'][0] / wall:.2f} | {med['HF'][1] / cpu:.2f} |")
    rows.append(f"first-step loss HF {first['HF']:.5f} mg {first['mg']:.5f} (|diff| {abs(first['HF'] - first['mg']):.1e})")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"threads={torch.get_num_threads()} fp32 layers={args.layers} batch={args.batch} seq={args.seq} "
          f"steps={args.steps} (median after 1 warm-up; T5 target length = seq/4)")
    print("| model | impl | tokens/s | x HF (wall) | x HF (CPU time) |\n|---|---|---|---|---|")
    print(bench(f"bert-base-shaped ({args.layers} layers)", bert_pair(args.layers, args.batch, args.seq), args.steps))
    print(bench(f"t5-small-shaped ({args.layers}+{args.layers} layers)", t5_pair(args.layers, args.batch, args.seq),
                args.steps))


if __name__ == "__main__":
    main()
