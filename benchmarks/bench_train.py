"""End-to-end `mg train` throughput, MFU and validation loss against nanoGPT's own train.py.

Run from the repository root:

    .venv/bin/python benchmarks/bench_train.py --nanogpt /path/to/nanoGPT-checkout [--iters 30]

Without ``--nanogpt`` (a checkout of karpathy/nanoGPT, which is never part of this repository) the
comparison is skipped with a message; ``--dp-only`` still runs the data-parallel part.

What it does, all on CPU in one run so that every figure has a reference measured next to it:

1. Builds a corpus (Python standard-library sources as JSONL documents), trains an 8192-entry
   SentencePiece tokenizer with ``mg tokenizer train`` and tokenizes with ``mg preprocess`` (uint16
   ``.bin``). The training/validation split is mg's own document split (``data.split``); nanoGPT gets
   the same two document ranges as flat ``train.bin``/``val.bin`` token files (our ``.bin`` layout),
   in a temporary directory that also links its ``train.py``, ``model.py`` and ``configurator.py``.
2. For each model (preset ``gpt-14m``: 6 layers, 6 heads, hidden 384; ``gpt-30m``: 8/8/512;
   sequence 256, micro-batch 8, vocabulary 8192, no bias) runs, interleaved and repeated:
   ``mg train`` fp32, nanoGPT fp32, ``mg train`` bf16, all with the same threads, learning-rate
   schedule, optimizer settings and iterations. Step times skip the first ``--skip`` iterations (and
   nanoGPT's last one, which includes its final evaluation). Ratios are per repeat, then the median.
3. Both evaluate once at the end (after the same number of training tokens) on the validation
   documents: nanoGPT's ``estimate_loss`` (random windows) and mg's ``eval`` (its first batches).
4. Data parallelism: ``mg train --nproc-per-node 2 --set train.threads=1`` against one process with
   ``train.threads=2``, the same global batch; efficiency = 1-process step time / 2-process step time.

MFU here = model FLOPs/token (mg_models.flops_per_token, the same formula for both) x tokens/s /
the square-matmul peak measured by this script with the same threads (fp32 and bf16); mg's own
``mfu`` (its own start-up peak measurement) is printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
MG = [sys.executable, "-m", "mg_cli.main"]
SHAPES = {"gpt-14m": dict(n_layer=6, n_head=6, n_embd=384), "gpt-30m": dict(n_layer=8, n_head=8, n_embd=512)}
SEQ, MICRO, VOCAB = 256, 8, 8192
LR, MIN_LR = 1e-3, 1e-4
ITER_RE = re.compile(r"^iter (\d+): loss ([-\d.naif]+), time ([\d.]+)ms")
EVAL_RE = re.compile(r"^step (\d+): train loss ([\d.]+), val loss ([\d.]+)")


def stdlib_corpus(path: Path, max_bytes: int) -> int:
    """Python standard-library sources as JSONL documents of 100 lines; returns the document count."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = total = 0
    with open(path, "w", encoding="utf-8") as f:
        for p in sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts):
            lines = p.read_text(encoding="utf-8", errors="replace").split("\n")
            for i in range(0, len(lines), 100):
                text = "\n".join(lines[i:i + 100])
                if text.strip():
                    f.write(json.dumps({"text": text}) + "\n")
                    docs += 1
                    total += len(text.encode())
            if total >= max_bytes:
                break
    return docs


def run(cmd: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 900) -> str:
    """Run ``cmd``; returns stdout+stderr; raises with the tail of the output on failure."""
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    return proc.stdout


def build_data(work: Path, corpus_mb: float, split: str) -> tuple[Path, Path, Path]:
    """Corpus -> tokenizer -> mg dataset -> nanoGPT data dir; returns (mg prefix, tokenizer, nanoGPT dir)."""
    from mg_data.gpt_indices import parse_split, split_ranges
    from mg_data.indexed import IndexedDataset

    corpus = work / "corpus.jsonl"
    docs = stdlib_corpus(corpus, int(corpus_mb * 1e6))
    t0 = time.perf_counter()
    run(MG + ["tokenizer", "train", "--input", str(corpus), "--output-prefix", str(work / "tok"),
              "--vocab-size", str(VOCAB), "--max-lines", "40000"])
    run(MG + ["preprocess", "--input", str(corpus), "--tokenizer-model", str(work / "tok.model"),
              "--output-prefix", str(work / "corpus"), "--append-eod", "--workers", "1"])
    prefix = work / "corpus_text_document"
    ds = IndexedDataset(prefix)
    assert ds.tokens.dtype == np.uint16, ds.tokens.dtype
    (tr0, tr1), (va0, va1), _ = split_ranges(ds.num_documents, parse_split(split))
    nano = work / "nanogpt_data"
    nano.mkdir()
    for name, (a, b) in (("train", (tr0, tr1)), ("val", (va0, va1))):
        np.concatenate([ds.get_document(i) for i in range(a, b)]).astype(np.uint16).tofile(nano / f"{name}.bin")
    with open(nano / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": VOCAB}, f)
    ntr = os.path.getsize(nano / "train.bin") // 2
    nva = os.path.getsize(nano / "val.bin") // 2
    print(f"data: {docs} docs ({corpus_mb:.0f} MB of stdlib sources), {ds.num_tokens} tokens; split {split}: "
          f"train docs [{tr0},{tr1}) {ntr} tokens, valid docs [{va0},{va1}) {nva} tokens; "
          f"tokenizer + preprocess {time.perf_counter() - t0:.1f} s")
    return prefix, work / "tok.model", nano


def matmul_peak(dtype: torch.dtype, threads: int, seconds: float = 1.0, n: int = 1024) -> float:
    """Achieved FLOP/s of n x n matmuls at ``threads`` intra-op threads (best of 3 windows)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    best = 0.0
    for _ in range(3):
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 3:
            a @ b
            reps += 1
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - t0))
    torch.set_num_threads(old)
    return best


def run_mg(work: Path, tag: str, prefix: Path, tok: Path, *, preset: str, precision: str, iters: int, warmup: int,
           eval_iters: int, threads: int, split: str, nproc: int = 1, global_batch: int = MICRO) -> dict:
    """One ``mg train`` run; returns its per-iteration step times, final val loss and mean mfu."""
    log = work / "runs" / tag
    cfg = {
        "model": {"type": "gpt", "preset": preset, "seq_length": SEQ, "dropout": 0.0},
        "train": {"micro_batch_size": MICRO, "global_batch_size": global_batch, "iters": iters, "seed": 1337,
                  "precision": precision, "threads": threads},
        "optim": {"lr": LR, "min_lr": MIN_LR, "warmup_iters": warmup, "decay_style": "cosine", "weight_decay": 0.1,
                  "clip_grad": 1.0, "adam_beta1": 0.9, "adam_beta2": 0.95},
        "data": {"path": str(prefix), "tokenizer_model": str(tok), "split": split},
        "eval": {"interval": 0, "iters": eval_iters},
        "checkpoint": {"save": None},
        "log": {"dir": str(log), "interval": 1},
    }
    path = work / f"{tag}.json"  # JSON is YAML
    path.write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    run(MG + ["train", "--config", str(path), "--nproc-per-node", str(nproc)], cwd=work)
    wall = time.perf_counter() - t0
    recs = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    vals = [r["val_loss"] for r in recs if "val_loss" in r]
    return {"times": [r["step_time_s"] for r in steps], "val": vals[-1] if vals else float("nan"),
            "loss": steps[-1]["loss"], "mfu": [r["mfu"] for r in steps], "wall": wall}


def run_nanogpt(work: Path, tag: str, nanogpt: Path, data: Path, *, preset: str, iters: int, warmup: int,
                eval_iters: int, threads: int) -> dict:
    """One nanoGPT train.py run (fp32, CPU) from a temporary directory; returns step times and val loss."""
    d = work / "nano" / tag
    (d / "data").mkdir(parents=True)
    for f in ("train.py", "model.py", "configurator.py"):
        (d / f).symlink_to(nanogpt / f)
    (d / "data" / "mgbench").symlink_to(data)
    shape = SHAPES[preset]
    args = dict(dataset="mgbench", out_dir=str(d / "out"), device="cpu", compile=False, dtype="float32",
                block_size=SEQ, batch_size=MICRO, gradient_accumulation_steps=1, bias=False, dropout=0.0,
                max_iters=iters, eval_interval=iters, eval_iters=eval_iters, log_interval=1,
                always_save_checkpoint=False, wandb_log=False, learning_rate=LR, min_lr=MIN_LR,
                warmup_iters=warmup, lr_decay_iters=iters, decay_lr=True, weight_decay=0.1, beta1=0.9,
                beta2=0.95, grad_clip=1.0, init_from="scratch", **shape)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    t0 = time.perf_counter()
    out = run([sys.executable, "train.py"] + [f"--{k}={v}" for k, v in args.items()], cwd=d, env=env)
    wall = time.perf_counter() - t0
    times, losses, val = {}, {}, float("nan")
    for line in out.splitlines():
        if m := ITER_RE.match(line):
            times[int(m.group(1))] = float(m.group(3)) / 1000
            losses[int(m.group(1))] = float(m.group(2))
        if (m := EVAL_RE.match(line)) and int(m.group(1)) == iters:
            val = float(m.group(3))
    # iteration i's log line times training step i (0-based); step `iters` also holds the final eval.
    return {"times": [times[i] for i in range(iters)], "val": val, "loss": losses.get(iters - 1), "wall": wall}


def fmt(runs: list[dict], key: str) -> str:
    return ", ".join(f"{r[key]:.3f}" for r in runs)


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def bench_models(work: Path, args: argparse.Namespace, prefix: Path, tok: Path, nano_data: Path) -> None:
    from mg_models import flops_per_token, get_config

    nanogpt = Path(args.nanogpt).resolve()
    for preset in args.models.split(","):
        fpt = flops_per_token(get_config(preset, max_position_embeddings=SEQ), SEQ)
        peaks = {"fp32": [], "bf16": []}
        res = {"mg_fp32": [], "nano_fp32": [], "mg_bf16": []}
        common = dict(preset=preset, iters=args.iters, warmup=args.warmup, eval_iters=args.eval_iters,
                      threads=args.threads)
        bf16 = args.bf16
        for r in range(args.repeats):
            peaks["fp32"].append(matmul_peak(torch.float32, args.threads))
            peaks["bf16"].append(matmul_peak(torch.bfloat16, args.threads))
            if bf16 == "auto" and peaks["bf16"][-1] < 0.5 * peaks["fp32"][-1]:
                bf16 = "off"
                print(f"  bf16 matmul runs at {peaks['bf16'][-1] / 1e9:.2f} GFLOP/s against fp32's "
                      f"{peaks['fp32'][-1] / 1e9:.1f} GFLOP/s on this CPU (no native bf16 matmul): the mg bf16 runs "
                      f"are skipped (--bf16 on forces them)", flush=True)
                res.pop("mg_bf16")
            res["mg_fp32"].append(run_mg(work, f"{preset}-mg-fp32-{r}", prefix, tok, precision="fp32",
                                         split=args.split, **common))
            res["nano_fp32"].append(run_nanogpt(work, f"{preset}-{r}", nanogpt, nano_data, **common))
            if bf16 != "off":
                res["mg_bf16"].append(run_mg(work, f"{preset}-mg-bf16-{r}", prefix, tok, precision="bf16",
                                             split=args.split, **common))
            print(f"  {preset} repeat {r}: " + ", ".join(
                f"{k} {med(v[-1]['times'][args.skip:]) * 1e3:.0f} ms/it (val {v[-1]['val']:.3f})"
                for k, v in res.items()) + f" | load {os.getloadavg()[0]:.1f}", flush=True)
        tok_step = MICRO * SEQ
        step = {k: [med(x["times"][args.skip:]) for x in v] for k, v in res.items()}
        peak32, peak16 = med(peaks["fp32"]), med(peaks["bf16"])
        r32 = med([n / m for m, n in zip(step["mg_fp32"], step["nano_fp32"], strict=True)])
        r16 = med([n / m for m, n in zip(step.get("mg_bf16", []), step["nano_fp32"], strict=False)])
        print(f"{preset} ({fpt / 6 / 1e6:.1f} M-param-equivalent FLOPs/token/6; {fpt / 1e6:.0f} MFLOP/token), "
              f"seq {SEQ}, micro-batch {MICRO}, {args.iters} iters ({args.skip} skipped), {args.threads} threads, "
              f"{args.repeats} interleaved repeats; matmul peak fp32 {peak32 / 1e9:.0f} GFLOP/s, "
              f"bf16 {peak16 / 1e9:.0f} GFLOP/s")
        for k, peak in (("nano_fp32", peak32), ("mg_fp32", peak32), ("mg_bf16", peak16)):
            if k not in res:
                continue
            s = med(step[k])
            own = f", mg's own mfu {med([med(x['mfu'][args.skip:]) for x in res[k]]):.3f}" if k.startswith("mg") else ""
            print(f"  {k:9s}: {s * 1e3:7.0f} ms/iter, {tok_step / s:6.0f} tokens/s, MFU {fpt * tok_step / s / peak:.3f}"
                  f"{own}; final val loss {fmt(res[k], 'val')}; last train loss {fmt(res[k], 'loss')}")
        print(f"  speed vs nanoGPT (median of per-repeat ratios of nanoGPT/mg step time): fp32 {r32:.2f}x "
              f"(target >= 1.0), mg bf16 " + (f"{r16:.2f}x (target >= 1.6)" if "mg_bf16" in res else "not run"))
        dv = [m["val"] - n["val"] for m, n in zip(res["mg_fp32"], res["nano_fp32"], strict=True)]
        dv16 = [m["val"] - n["val"] for m, n in zip(res.get("mg_bf16", []), res["nano_fp32"], strict=False)]
        print(f"  val loss mg - nanoGPT after {args.iters * tok_step} tokens: fp32 {', '.join(f'{x:+.3f}' for x in dv)}; "
              f"bf16 {', '.join(f'{x:+.3f}' for x in dv16)} (target <= 0)", flush=True)


def bench_dp(work: Path, args: argparse.Namespace, prefix: Path, tok: Path) -> None:
    preset = args.models.split(",")[0]
    common = dict(preset=preset, precision="fp32", iters=args.dp_iters, warmup=args.warmup, eval_iters=1,
                  split=args.split, global_batch=2 * MICRO)
    one, two = [], []
    skip = min(args.skip, args.dp_iters - 2)
    for r in range(args.dp_repeats):
        one.append(run_mg(work, f"dp1-{r}", prefix, tok, threads=2, nproc=1, **common))
        two.append(run_mg(work, f"dp2-{r}", prefix, tok, threads=1, nproc=2, **common))
        print(f"  dp repeat {r}: 1 proc x 2 threads {med(one[-1]['times'][skip:]) * 1e3:.0f} ms/it, "
              f"2 procs x 1 thread {med(two[-1]['times'][skip:]) * 1e3:.0f} ms/it | load {os.getloadavg()[0]:.1f}",
              flush=True)
    eff = [med(a["times"][skip:]) / med(b["times"][skip:]) for a, b in zip(one, two, strict=True)]
    print(f"dp=2 ({preset}, fp32, global batch {2 * MICRO} = 2 x micro {MICRO}, {args.dp_iters} iters, "
          f"{skip} skipped): efficiency (1-proc step / 2-proc step) per repeat "
          f"{', '.join(f'{e:.2f}' for e in eff)}, median {med(eff):.2f} (target >= 0.85)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nanogpt", help="path of a karpathy/nanoGPT checkout (omit: the comparison is skipped)")
    ap.add_argument("--models", default="gpt-14m,gpt-30m", help="comma-separated mg presets")
    ap.add_argument("--iters", type=int, default=30, help="training iterations per timed run")
    ap.add_argument("--skip", type=int, default=5, help="warm-up iterations left out of the step time")
    ap.add_argument("--warmup", type=int, default=5, help="learning-rate warm-up iterations (both)")
    ap.add_argument("--eval-iters", type=int, default=10, help="validation batches of the final evaluation")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved repeats of every run")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of every single-process run")
    ap.add_argument("--bf16", choices=("auto", "on", "off"), default="auto",
                    help="mg bf16 runs (auto: skipped when this CPU's bf16 matmul is under half its fp32 speed)")
    ap.add_argument("--dp-iters", type=int, default=15, help="iterations of each data-parallel run (0: skip)")
    ap.add_argument("--dp-repeats", type=int, default=2, help="interleaved repeats of the data-parallel pair")
    ap.add_argument("--dp-only", action="store_true", help="only the data-parallel comparison")
    ap.add_argument("--corpus-mb", type=float, default=4.0)
    ap.add_argument("--split", default="90,10,0")
    args = ap.parse_args()
    if args.nanogpt is None and not args.dp_only:
        print("bench_train: skipped the nanoGPT comparison: pass --nanogpt PATH (a karpathy/nanoGPT checkout); "
              "--dp-only runs only the data-parallel part")
        return
    if args.nanogpt is not None and not (Path(args.nanogpt) / "train.py").is_file():
        sys.exit(f"--nanogpt {args.nanogpt}: no train.py there; pass the root of a karpathy/nanoGPT checkout")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()}", flush=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        work = Path(tmp)
        prefix, tok, nano_data = build_data(work, args.corpus_mb, args.split)
        if not args.dp_only:
            bench_models(work, args, prefix, tok, nano_data)
        if args.dp_iters > 0:
            bench_dp(work, args, prefix, tok)
    print(f"total {time.perf_counter() - t0:.0f} s, load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
