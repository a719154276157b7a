"""mg eval's log-likelihood scoring against lm-evaluation-harness's ``hf`` backend, and mg's strided perplexity
against a plain Hugging Face loop, on the same random GPT-2 directory, texts and thread count.

1. Multiple choice: one local task YAML over a JSONL written here, run through ``lm_eval.simple_evaluate``
   with mg's adapter (``MgLM``) and with the harness's ``HFLM`` at the same batch size, fp32, alternated.
   Both the whole ``simple_evaluate`` call and the time inside ``loglikelihood`` (wall and CPU) are reported, and the
   two accuracies are checked to be equal.
2. Strided perplexity: mg's ``perplexity`` task (``EvalOptions(stride=...)``) against the standard loop
   (one window of at most ``max_length`` tokens per forward, advanced by ``stride``, labels -100 on the
   tokens an earlier window already scored), each document predicted from the end-of-text token. The
   loop's window counts the token whose label the shift drops, so mg runs at ``--max-length max_length - 1``:
   every token is then predicted from the same context on both sides. mg runs at ``--batch`` windows per
   forward and at one (the loop's).

    .venv/bin/python benchmarks/bench_eval.py [--layers 4] [--hidden 384] [--vocab 50257] [--batch 8]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "shi", "den", "par", "ol", "ex", "im", "qu", "ber", "tor"]


def _words(rng: random.Random, n: int) -> list[str]:
    return ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(n)]


def _sentence(rng: random.Random, lexicon: list[str], n: int) -> str:
    return " ".join(rng.choice(lexicon) for _ in range(n))


def build_model_dir(d: Path, args: argparse.Namespace, lexicon: list[str]) -> int:
    """A byte-level BPE tokenizer trained on generated text and a random GPT-2 saved in ``d``; returns parameters."""
    import tokenizers
    import transformers

    rng = random.Random(1)
    corpus = [_sentence(rng, lexicon, 30) for _ in range(2000)]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=2000, special_tokens=["<|endoftext|>", "<unk>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<unk>")
    fast.save_pretrained(d)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=max(args.vocab, len(fast)), n_embd=args.hidden, n_layer=args.layers, n_head=args.hidden // 64,
        n_positions=args.context, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    model.save_pretrained(d)
    return sum(p.numel() for p in model.parameters())


def write_tasks(d: Path, args: argparse.Namespace, lexicon: list[str]) -> None:
    rng = random.Random(2)
    rows = [{"context": _sentence(rng, lexicon, rng.randint(20, 40)) + ":",
             "choices": [_sentence(rng, lexicon, rng.randint(2, 6)) for _ in range(4)], "answer": i % 4}
            for i in range(args.questions)]
    (d / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"task": "mg_bench_mc", "dataset_path": "json",
           "dataset_kwargs": {"data_files": {"test": str(d / "mc.jsonl")}}, "test_split": "test",
           "output_type": "multiple_choice", "doc_to_text": "{{context}}", "doc_to_choice": "{{choices}}",
           "doc_to_target": "answer", "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}
    (d / "mc.yaml").write_text(json.dumps(cfg))  # JSON is YAML
    texts = [_sentence(rng, lexicon, args.doc_words) for _ in range(args.docs)]
    (d / "ppl.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


# -- 1. multiple choice through simple_evaluate ----------------------------------------------------------
def _timed(lm: Any) -> list[tuple[float, float]]:
    """Record the (wall, process CPU) seconds each ``loglikelihood`` call of ``lm`` takes (an instance attribute
    shadows the method). CPU time is the steadier of the two when other jobs share the cores."""
    spent: list[tuple[float, float]] = []
    inner = lm.loglikelihood

    def loglikelihood(requests: Any, *a: Any, **kw: Any) -> Any:
        t0, c0 = time.perf_counter(), time.process_time()
        out = inner(requests, *a, **kw)
        spent.append((time.perf_counter() - t0, time.process_time() - c0))
        loglikelihood.requests = len(requests)  # type: ignore[attr-defined]
        return out

    lm.loglikelihood = loglikelihood
    return spent


def bench_choice(model_dir: Path, tasks_dir: Path, args: argparse.Namespace) -> None:
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from mg_cli.evaluation.harness import MgLM

    manager = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    lms = {"mg (MgLM)": MgLM.from_checkpoint(model_dir, batch_size=args.batch),
           "harness hf (HFLM)": HFLM(pretrained=str(model_dir), dtype="float32", device="cpu", batch_size=args.batch)}
    inner = {name: _timed(lm) for name, lm in lms.items()}

    def evaluate(name: str, limit: int | None = None) -> tuple[float, dict[str, Any]]:
        t0 = time.perf_counter()
        out = lm_eval.simple_evaluate(model=lms[name], tasks=["mg_bench_mc"], task_manager=manager, limit=limit,
                                      bootstrap_iters=0, log_samples=False)
        return time.perf_counter() - t0, out["results"]["mg_bench_mc"]

    for name in lms:  # warm-up
        evaluate(name, limit=4)
        inner[name].clear()
    whole: dict[str, list[float]] = {n: [] for n in lms}
    results: dict[str, dict[str, Any]] = {}
    names = list(lms)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            t, results[name] = evaluate(name)
            whole[name].append(t)
    n_req = lms[names[0]].loglikelihood.requests
    print(f"multiple choice: {args.questions} questions x 4 choices = {n_req} loglikelihood requests, "
          f"batch {args.batch}, fp32, 1 thread, {args.rounds} alternated rounds each, best round")
    wall = {n: min(t for t, _ in inner[n]) for n in names}
    cpu = {n: min(c for _, c in inner[n]) for n in names}
    for name in names:
        print(f"  {name:18s} simple_evaluate {min(whole[name]):6.2f} s  ({n_req / min(whole[name]):6.1f} req/s)   "
              f"in loglikelihood {wall[name]:6.2f} s  ({n_req / wall[name]:6.1f} req/s, {cpu[name]:6.2f} s CPU)")
    a, b = names
    print(f"  ratio hf / mg: simple_evaluate {min(whole[b]) / min(whole[a]):.2f}x, "
          f"loglikelihood {wall[b] / wall[a]:.2f}x (CPU time {cpu[b] / cpu[a]:.2f}x)")
    for key in ("acc,none", "acc_norm,none"):
        va, vb = results[a][key], results[b][key]
        print(f"  {key.split(',')[0]:8s} mg {va:.4f}  hf {vb:.4f}  {'equal' if va == vb else 'DIFFERENT'}")


# -- 2. strided perplexity ---------------------------------------------------------------------------------
def hf_strided_nll(model: Any, docs: list[list[int]], prefix: int, max_length: int, stride: int
                   ) -> tuple[float, int]:
    """Total NLL (nats) and scored tokens of ``docs`` with the standard strided loop, one window per forward.

    Each document is ``[prefix, *tokens]``; a window covers ``seq[begin:begin + max_length]`` for begin = 0,
    stride, 2 stride, ... and is scored only on the tokens past the previous window's end.
    """
    total, count = 0.0, 0
    with torch.no_grad():
        for toks in docs:
            seq = torch.tensor([[prefix, *toks]])
            n, prev_end = seq.shape[1], 0
            for begin in range(0, n, stride):
                end = min(begin + max_length, n)
                new = end - max(prev_end, begin + 1)  # labels of the window's first token are never scored
                labels = seq[:, begin:end].clone()
                labels[:, : labels.shape[1] - new] = -100
                loss = model(seq[:, begin:end], labels=labels).loss  # mean over the `new` scored tokens
                total += float(loss) * new
                count += new
                prev_end = end
                if end == n:
                    break
    return total, count


def bench_perplexity(model_dir: Path, tasks_dir: Path, args: argparse.Namespace) -> None:
    import transformers

    from mg_cli.evaluation.evaluate import EvalOptions, Evaluator
    from mg_cli.evaluation.layouts import build_runner
    from mg_cli.evaluation.lm import LMScorer
    from mg_cli.evaluation.tasks import TaskSpec
    from mg_data import build_tokenizer

    path = str(tasks_dir / "ppl.jsonl")
    runner, _, _ = build_runner(model_dir, max_length=args.context - 1)
    tok = build_tokenizer(str(model_dir / "tokenizer.json"))
    evaluators = {b: Evaluator(LMScorer(runner, tok, batch_size=b), EvalOptions(stride=args.stride))
                  for b in (args.batch, 1)}
    hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    hf_model = transformers.GPT2LMHeadModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = [json.loads(line)["text"] for line in Path(path).read_text().splitlines()]

    def mg(batch: int) -> tuple[float, int]:
        r = evaluators[batch].run(TaskSpec(kind="perplexity", path=path))
        return r["metrics"]["nll_per_token"]["value"] * r["tokens"], r["tokens"]

    def hf() -> tuple[float, int]:
        docs = [hf_tok(t)["input_ids"] for t in texts]
        return hf_strided_nll(hf_model, docs, hf_tok.eos_token_id, args.context, args.stride)

    sides = {f"mg perplexity, batch {args.batch}": lambda: mg(args.batch), "mg perplexity, batch 1": lambda: mg(1),
             "plain HF strided loop": hf}
    times: dict[str, list[float]] = {n: [] for n in sides}
    cpu: dict[str, list[float]] = {n: [] for n in sides}
    out: dict[str, tuple[float, int]] = {}
    names = list(sides)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            t0, c0 = time.perf_counter(), time.process_time()
            out[name] = sides[name]()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    tokens = out[names[0]][1]
    print(f"strided perplexity: {args.docs} documents, {tokens} tokens, max_length {args.context}, stride "
          f"{args.stride}, HF one window per forward, fp32, 1 thread, "
          f"{args.rounds} alternated rounds each, best round")
    for name in names:
        nll, n = out[name]
        print(f"  {name:24s} {min(times[name]):6.2f} s  {n / min(times[name]):7.1f} tokens/s  "
              f"{min(cpu[name]):6.2f} s CPU  perplexity {math.exp(nll / n):.4f}  ({n} tokens)")
    ref = names[-1]
    ppl = {n: math.exp(out[n][0] / out[n][1]) for n in names}
    for name in names[:-1]:
        print(f"  ratio HF / {name}: time {min(times[ref]) / min(times[name]):.2f}x (CPU time "
              f"{min(cpu[ref]) / min(cpu[name]):.2f}x), perplexity relative "
              f"difference {abs(ppl[name] - ppl[ref]) / ppl[ref]:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--vocab", type=int, default=50257, help="model vocabulary (GPT-2's by default)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--questions", type=int, default=80)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-words", type=int, default=600)
    ap.add_argument("--stride", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", choices=["choice", "perplexity"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    lexicon = _words(random.Random(0), 3000)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, tasks_dir = Path(tmp, "model"), Path(tmp, "tasks")
        model_dir.mkdir()
        tasks_dir.mkdir()
        params = build_model_dir(model_dir, args, lexicon)
        write_tasks(tasks_dir, args, lexicon)
        print(f"random GPT-2: {args.layers} layers, hidden {args.hidden}, vocab {max(args.vocab, 2000)}, context "
              f"{args.context}, {params / 1e6:.1f}M parameters; load average {os.getloadavg()[0]:.2f}")
        if args.only != "perplexity":
            bench_choice(model_dir, tasks_dir, args)
        if args.only != "choice":
            bench_perplexity(model_dir, tasks_dir, args)
        print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
