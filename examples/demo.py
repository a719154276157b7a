"""The end-to-end demo behind ``make demo``.

1. builds a corpus from the Python standard library's own sources (real text, no download),
2. trains a SentencePiece tokenizer on it that keeps line breaks and indentation
   (``mg tokenizer train``), so generated code keeps its lines,
3. preprocesses it into a Megatron-compatible dataset (``mg preprocess``),
4. trains a small GPT on the CPU with 2 processes, tensor parallel (``mg train``), with periodic
   validation and checkpoints,
5. generates a continuation of a prompt (``mg generate``) and draws the loss curves (``mg plot``).

The validation loss is printed in nats per token and in bits per UTF-8 byte of the scored text;
the latter compares across tokenizers.

Everything lands in ``demo/`` (or ``--workdir``). Each step prints the ``mg`` command it runs, so
the demo doubles as a tutorial.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

DEMO_CONFIG = """\
# The demo run: a ~6M-parameter GPT on Python sources, 2 processes (tp=2) on a CPU.
model:
  type: gpt
  num_layers: 4
  hidden_size: 256
  num_attention_heads: 4
  ffn_hidden_size: 1024
  seq_length: 128
  position_embedding: rope
  normalization: rmsnorm
  activation: swiglu
  tie_embeddings: true
  bias: false
parallel:
  tp: 2
train:
  micro_batch_size: 8
  global_batch_size: 16
  iters: {iters}
  seed: 1234
  precision: {precision}
optim:
  lr: 3.0e-3
  min_lr: 3.0e-4
  warmup_iters: 20
  decay_style: cosine
  weight_decay: 0.1
  clip_grad: 1.0
  adam_beta2: 0.98
data:
  path: {data}
  tokenizer_model: {tokenizer}
  split: "98,2,0"
  num_workers: 0
eval:
  interval: {eval_interval}
  iters: 4
checkpoint:
  save: {ckpt}
  interval: {ckpt_interval}
  keep_last: 2
log:
  dir: {logdir}
  interval: 10
"""


def build_corpus(out: Path, max_bytes: int) -> Path:
    """One JSON line per standard-library source file, in sorted path order (deterministic)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    with open(out, "w") as f:
        for path in sorted(root.rglob("*.py")):
            if "test" in path.parts or "site-packages" in path.parts:
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            if not text.strip():
                continue
            f.write(json.dumps({"text": text}) + "\n")
            total += len(text.encode())
            if total >= max_bytes:
                break
    return out


def run(*args: str) -> None:
    print(f"\n$ mg {shlex.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "mg_cli.main", *args], check=True)


def unigram_entropy(prefix: str) -> float:
    """Entropy (nats/token) of the corpus's unigram distribution: the loss of a model that ignores context."""
    from mg_data import IndexedDataset

    counts = np.bincount(np.asarray(IndexedDataset(prefix).tokens, dtype=np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def token_byte_lengths(model: str) -> np.ndarray:
    """UTF-8 bytes each id of a SentencePiece model stands for (byte pieces 1, control pieces 0)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=model)
    out = np.zeros(sp.get_piece_size(), dtype=np.int64)
    for i in range(len(out)):
        if sp.is_byte(i):
            out[i] = 1
        elif not (sp.is_control(i) or sp.is_unknown(i)):
            out[i] = len(sp.id_to_piece(i).replace("\u2581", " ").encode())
    return out


def scored_tokens_and_bytes(config: dict, byte_lengths: np.ndarray) -> tuple[int, int]:
    """Tokens and UTF-8 bytes of the labels ``mg train`` scores at each validation.

    They are the first ``eval.iters`` global batches of the validation split, rebuilt here the
    way ``mg train`` builds them (same seed, split and numbers of samples).
    """
    from mg_data import GPTDatasetConfig, build_gpt_datasets

    t, e = config["train"], config["eval"]
    gbs = t["global_batch_size"]
    evals = t["iters"] // e["interval"] + 1
    ds_config = GPTDatasetConfig(seq_length=config["model"]["seq_length"], seed=t["seed"],
                                 split=config["data"]["split"])
    _, valid, _ = build_gpt_datasets(ds_config, [str(config["data"]["path"])],
                                     (t["iters"] * gbs, e["iters"] * gbs * evals, None))
    n = min(e["iters"], len(valid) // gbs) * gbs
    labels = np.concatenate([valid[i]["labels"][valid[i]["loss_mask"] > 0] for i in range(n)])
    return len(labels), int(byte_lengths[labels].sum())


def fastest_precision() -> str:
    """bf16 when its matmuls beat fp32's here (CPUs with AVX-512 BF16/AMX, GPUs), else fp32."""
    import torch

    def rate(dtype: torch.dtype) -> float:
        a = torch.randn(512, 512).to(dtype)
        a @ a
        t0, reps = time.perf_counter(), 0
        while time.perf_counter() - t0 < 0.2:
            a @ a
            reps += 1
        return reps / (time.perf_counter() - t0)

    return "bf16" if rate(torch.bfloat16) > 1.2 * rate(torch.float32) else "fp32"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="demo")
    parser.add_argument("--iters", type=int, default=240)
    parser.add_argument("--corpus-mb", type=float, default=8.0)
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"],
                        help="auto: bf16 when this CPU/GPU multiplies bf16 faster than fp32, else fp32")
    args = parser.parse_args()
    import yaml

    from mg_data import build_tokenizer

    start = time.monotonic()
    if args.precision == "auto":
        args.precision = fastest_precision()
        print(f"precision: {args.precision} (the faster matmul on this machine)", flush=True)
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)

    corpus = work / "stdlib.jsonl"
    if not corpus.exists():
        print(f"building a corpus from {sysconfig.get_paths()['stdlib']} ...", flush=True)
        build_corpus(corpus, int(args.corpus_mb * 1e6))
    tok = work / "tokenizer"
    prefix = work / "stdlib_text_document"
    if (work / "tokenizer.model").exists() and not build_tokenizer(f"{tok}.model").exact_whitespace:
        print("retraining the tokenizer of an earlier demo, which dropped line breaks", flush=True)
        for old in (f"{tok}.model", f"{tok}.vocab", f"{prefix}.bin", f"{prefix}.idx"):
            Path(old).unlink(missing_ok=True)
    if not (work / "tokenizer.model").exists():
        run("tokenizer", "train", "--input", str(corpus), "--output-prefix", str(tok), "--vocab-size", "4096",
            "--max-lines", "200000", "--exact-whitespace")
    if not Path(str(prefix) + ".idx").exists():
        run("preprocess", "--input", str(corpus), "--tokenizer-model", f"{tok}.model",
            "--output-prefix", str(work / "stdlib"), "--append-eod", "--workers", "2", "--partition-mb", "2")
    run("inspect", str(prefix))

    run_dir = work / "run"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    run_dir.mkdir()
    config = run_dir / "config.yaml"
    config.write_text(DEMO_CONFIG.format(
        iters=args.iters, precision=args.precision, data=prefix, tokenizer=f"{tok}.model",
        eval_interval=max(1, args.iters // 4), ckpt_interval=max(1, args.iters // 2),
        ckpt=run_dir / "checkpoints", logdir=run_dir / "logs"))
    run("train", "--config", str(config), "--nproc-per-node", "2")

    rows = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    entropy = unigram_entropy(str(prefix))
    scored, scored_bytes = scored_tokens_and_bytes(yaml.safe_load(config.read_text()),
                                                   token_byte_lengths(f"{tok}.model"))
    bits_per_byte = val[-1] * scored / math.log(2) / scored_bytes
    gen_args = ["generate", "--checkpoint", str(run_dir / "checkpoints"), "--prompt", "def read_config(path):",
                "--max-new-tokens", "64", "--temperature", "0.8", "--top-k", "40", "--seed", "1"]
    print(f"\n$ mg {shlex.join(gen_args)}", flush=True)
    out = subprocess.run([sys.executable, "-m", "mg_cli.main", *gen_args], check=True, capture_output=True,
                         text=True).stdout
    png = subprocess.run([sys.executable, "-m", "mg_cli.main", "plot", str(run_dir / "logs")], check=True,
                         capture_output=True, text=True).stdout.strip()
    print("\n" + "=" * 72)
    print(f"validation loss {val[-1]:.2f} nats/token, {bits_per_byte:.2f} bits/byte "
          f"({scored} tokens, {scored_bytes} bytes; unigram entropy {entropy:.2f} nats/token), "
          f"perplexity {math.exp(val[-1]):.1f}")
    print("generated (line breaks as produced):")
    print("-" * 72)
    print(out.rstrip("\n"))
    print("-" * 72)
    print(f"loss curves: {png}")
    print(f"checkpoints: {run_dir / 'checkpoints'}  (mg inspect {run_dir / 'checkpoints'})")
    print(f"demo finished in {(time.monotonic() - start) / 60:.1f} min")


if __name__ == "__main__":
    main()
