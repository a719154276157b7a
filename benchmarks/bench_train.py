"""End-to-end `mg train` against nanoGPT's own train.py: speed, MFU and validation loss per token.

Run from the repository root:

    .venv/bin/python benchmarks/bench_train.py --nanogpt /path/to/nanoGPT-checkout

Without ``--nanogpt`` (a checkout of karpathy/nanoGPT, which is never part of this repository) the
comparison is skipped with a message; ``--dp-only`` still runs the data-parallel part.

What it does, all on CPU in one run so that every figure has a reference measured next to it:

1. Builds a corpus (Python standard-library sources as JSONL documents), trains a SentencePiece
   tokenizer with ``mg tokenizer train`` and tokenizes with ``mg preprocess`` (uint16 ``.bin``). The
   training/validation split is mg's own document split (``data.split``); nanoGPT gets the same two
   document ranges as flat ``train.bin``/``val.bin`` token files (our ``.bin`` layout).
2. Trains the same model with both, once per seed (``--repeats``), one after the other or (with
   ``--concurrent``) side by side so that both see the same machine load: same shape (learned
   positions, LayerNorm, GELU MLP 4h, tied embeddings, dropout 0, biases (``--bias``, the default:
   mg's LayerNorm always has a bias, nanoGPT's only with bias=True), init N(0, 0.02)
   with residual projections at 0.02/sqrt(2 layers)), same micro-batch and no accumulation, same
   AdamW (betas, eps, weight decay on the >= 2-D tensors only), clipping at norm 1, and the same
   learning rate at every step: mg's warm-up is ``lr * k / W`` at 1-based iteration k, nanoGPT's is
   ``lr * (it + 1) / (W' + 1)`` at 0-based ``it = k - 1``, so nanoGPT gets ``warmup_iters = W - 1``
   and ``lr_decay_iters = N - 1``, which makes its cosine equal to mg's at every step (checked
   against mg's logged lr). nanoGPT runs unmodified through a two-line shim that adds the repeat's
   seed offset to its fixed ``torch.manual_seed(1337)`` and keeps each evaluation's checkpoint
   under its own name instead of overwriting ``ckpt.pt``.
3. Validation loss after the same number of training tokens, at every ``--eval-interval``: both
   models' checkpoints are evaluated here on identical windows (all non-overlapping ``--seq``-token
   windows of ``val.bin``), so the comparison is paired; the standard error of the mean
   difference is computed from its spread over the validation batches, and across seeds from the
   per-seed differences. Each side's own evaluation (nanoGPT's random windows, mg's first
   validation batches) is printed beside it. Before the runs, ``same_start_trajectory`` trains
   both from the same initial weights on the same batches in one process (``--same-start-steps``),
   which separates implementation differences from random ones.
4. Data parallelism: ``mg train --nproc-per-node 2 --set train.threads=1`` against one process with
   ``train.threads=2`` and one with ``train.threads=1``, the same global batch (see ``bench_dp``).

MFU here = model FLOPs/token (mg_models.flops_per_token, the same formula for both) x tokens/s /
the square-matmul peak measured by this script with the same threads.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import pickle
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
MG = [sys.executable, "-m", "mg_cli.main"]
# nanoGPT's CPU example shape (README: 4 layers, 4 heads, 128 wide, block 64, batch 12) and the two presets.
SHAPES = {"nano-cpu": dict(n_layer=4, n_head=4, n_embd=128), "gpt-14m": dict(n_layer=6, n_head=6, n_embd=384),
          "gpt-30m": dict(n_layer=8, n_head=8, n_embd=512)}
LR, MIN_LR, WD, BETAS, CLIP = 1e-3, 1e-4, 0.1, (0.9, 0.95), 1.0
ITER_RE = re.compile(r"^iter (\d+): loss ([-\d.naif]+), time ([\d.]+)ms")
EVAL_RE = re.compile(r"^step (\d+): train loss ([\d.]+), val loss ([\d.]+)")
# Runs train.py unmodified, with the seed offset of this repeat added to its fixed seed and every
# checkpoint kept under its iteration number (train.py overwrites one ckpt.pt).
NANO_SHIM = """import runpy, sys, torch
off = int(sys.argv.pop(1)); seed, save = torch.manual_seed, torch.save
torch.manual_seed = lambda s: seed(s + off)
torch.save = lambda obj, f, *a, **k: save(obj, str(f).replace("ckpt.pt", f"ckpt_{obj['iter_num']}.pt"), *a, **k)
runpy.run_path("train.py", run_name="__main__")
"""


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


def run(cmd: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 1800) -> str:
    """Run ``cmd``; returns stdout+stderr; raises with the tail of the output on failure."""
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    return proc.stdout


def build_data(work: Path, corpus_mb: float, split: str, vocab: int) -> tuple[Path, Path, Path]:
    """Corpus -> tokenizer -> mg dataset -> nanoGPT data dir; returns (mg prefix, tokenizer, nanoGPT dir)."""
    from mg_data.gpt_indices import parse_split, split_ranges
    from mg_data.indexed import IndexedDataset

    corpus = work / "corpus.jsonl"
    docs = stdlib_corpus(corpus, int(corpus_mb * 1e6))
    t0 = time.perf_counter()
    run(MG + ["tokenizer", "train", "--input", str(corpus), "--output-prefix", str(work / "tok"),
              "--vocab-size", str(vocab), "--max-lines", "40000"])
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
        pickle.dump({"vocab_size": vocab}, f)
    ntr = os.path.getsize(nano / "train.bin") // 2
    nva = os.path.getsize(nano / "val.bin") // 2
    print(f"data: {docs} docs ({corpus_mb:g} MB of stdlib sources), {ds.num_tokens} tokens, vocabulary {vocab}; "
          f"split {split}: train docs [{tr0},{tr1}) {ntr} tokens, valid docs [{va0},{va1}) {nva} tokens; "
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


def nanogpt_lr(it: int, warmup: int, decay_iters: int) -> float:
    """nanoGPT's documented schedule at 0-based step ``it``: linear warm-up to LR over ``warmup + 1``
    steps, cosine from LR to MIN_LR between ``warmup`` and ``decay_iters``, MIN_LR after."""
    if it < warmup:
        return LR * (it + 1) / (warmup + 1)
    if it > decay_iters:
        return MIN_LR
    ratio = (it - warmup) / (decay_iters - warmup)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LR - MIN_LR)


def mg_model_keys(shape: str, bias: bool) -> dict:
    """mg ``model`` config keys of ``shape``: the preset, or the explicit nanoGPT-style fields."""
    s = SHAPES[shape]
    if shape.startswith("gpt-"):
        return {"preset": shape, "bias": bias}
    return {"num_layers": s["n_layer"], "num_attention_heads": s["n_head"], "hidden_size": s["n_embd"],
            "bias": bias, "tie_embeddings": True, "init_std": 0.02}


def run_mg(work: Path, tag: str, prefix: Path, tok: Path, *, shape: str, seq: int, micro: int, iters: int,
           warmup: int, eval_interval: int, eval_iters: int, threads: int, split: str, bias: bool, seed: int = 1337,
           nproc: int = 1, global_batch: int | None = None, save: bool = True) -> dict:
    """One ``mg train`` fp32 run; returns step times, lrs, its own val losses and its checkpoint directory."""
    log = work / "runs" / tag
    ckpt = work / "ckpt" / tag
    cfg = {
        "model": {"type": "gpt", **mg_model_keys(shape, bias), "seq_length": seq, "dropout": 0.0},
        "train": {"micro_batch_size": micro, "global_batch_size": global_batch or micro, "iters": iters,
                  "seed": seed, "precision": "fp32", "threads": threads},
        "optim": {"lr": LR, "min_lr": MIN_LR, "warmup_iters": warmup, "decay_style": "cosine", "weight_decay": WD,
                  "clip_grad": CLIP, "adam_beta1": BETAS[0], "adam_beta2": BETAS[1], "adam_eps": 1e-8},
        "data": {"path": str(prefix), "tokenizer_model": str(tok), "split": split},
        "eval": {"interval": eval_interval, "iters": eval_iters},
        "checkpoint": {"save": str(ckpt) if save else None, "interval": eval_interval if save else 0,
                       "keep_last": None},
        "log": {"dir": str(log), "interval": 1},
    }
    path = work / f"{tag}.json"  # JSON is YAML
    path.write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    run(MG + ["train", "--config", str(path), "--nproc-per-node", str(nproc)], cwd=work)
    wall = time.perf_counter() - t0
    recs = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    steps = {r["iteration"]: r for r in recs if "loss" in r}
    vals = {r["iteration"]: r["val_loss"] for r in recs if "val_loss" in r}
    return {"times": [steps[k]["step_time_s"] for k in sorted(steps)], "lr": [steps[k]["lr"] for k in sorted(steps)],
            "vals": vals, "losses": [steps[k]["loss"] for k in sorted(steps)], "wall": wall, "ckpt": ckpt}


def run_nanogpt(work: Path, tag: str, nanogpt: Path, data: Path, *, shape: str, seq: int, micro: int, iters: int,
                warmup: int, eval_interval: int, eval_iters: int, threads: int, bias: bool, seed: int = 1337) -> dict:
    """One nanoGPT train.py run (fp32, CPU, its own seed + ``seed - 1337``) from a temporary directory."""
    d = work / "nano" / tag
    (d / "data").mkdir(parents=True)
    for f in ("train.py", "model.py", "configurator.py"):
        (d / f).symlink_to(nanogpt / f)
    (d / "shim.py").write_text(NANO_SHIM)
    (d / "data" / "mgbench").symlink_to(data)
    args = dict(dataset="mgbench", out_dir=str(d / "out"), device="cpu", compile=False, dtype="float32",
                block_size=seq, batch_size=micro, gradient_accumulation_steps=1, bias=bias, dropout=0.0,
                max_iters=iters, eval_interval=eval_interval, eval_iters=eval_iters, log_interval=1,
                always_save_checkpoint=True, wandb_log=False, learning_rate=LR, min_lr=MIN_LR,
                warmup_iters=warmup - 1, lr_decay_iters=iters - 1, decay_lr=True, weight_decay=WD, beta1=BETAS[0],
                beta2=BETAS[1], grad_clip=CLIP, init_from="scratch", **SHAPES[shape])
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    t0 = time.perf_counter()
    out = run([sys.executable, "shim.py", str(seed - 1337)] + [f"--{k}={v}" for k, v in args.items()], cwd=d, env=env)
    wall = time.perf_counter() - t0
    times, losses, vals = {}, {}, {}
    for line in out.splitlines():
        if m := ITER_RE.match(line):
            times[int(m.group(1))] = float(m.group(3)) / 1000
            losses[int(m.group(1))] = float(m.group(2))
        if m := EVAL_RE.match(line):
            vals[int(m.group(1))] = float(m.group(3))
    # Step `it` (0-based) is logged as iteration it; an evaluation at `it` is timed inside that line, so
    # those steps are left out of the step time.
    timed = [times[i] for i in range(iters) if i % eval_interval]
    return {"times": timed, "vals": vals, "losses": [losses[i] for i in range(iters)], "wall": wall, "ckpt": d / "out",
            "lr": [nanogpt_lr(i, warmup - 1, iters - 1) for i in range(iters)]}


def val_windows(val_bin: Path, seq: int, micro: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """All non-overlapping ``seq``-token windows of ``val_bin`` (+1 target token) in batches of ``micro``."""
    data = torch.from_numpy(np.fromfile(val_bin, dtype=np.uint16).astype(np.int64))
    n = (data.numel() - 1) // seq
    x = data[: n * seq].view(n, seq)
    y = data[1 : n * seq + 1].view(n, seq)
    nb = n // micro
    return [(x[i * micro:(i + 1) * micro], y[i * micro:(i + 1) * micro]) for i in range(nb)]


@torch.no_grad()
def paired_eval(mg_ckpt: Path, nano_ckpt: Path, nanogpt: Path, batches: list) -> tuple[np.ndarray, np.ndarray]:
    """Per-batch mean validation loss of an mg checkpoint and a nanoGPT checkpoint on the same batches."""
    from mg_models.loading import load_model

    mg = load_model(mg_ckpt, inference=True).model
    if str(nanogpt) not in sys.path:
        sys.path.insert(0, str(nanogpt))
    from model import GPT, GPTConfig  # nanoGPT's model.py, from the checkout given on the command line

    ck = torch.load(nano_ckpt, map_location="cpu")
    with contextlib.redirect_stdout(io.StringIO()):  # its parameter-count line
        nano = GPT(GPTConfig(**ck["model_args"]))
    nano.load_state_dict(ck["model"])
    nano.eval()
    a, b = [], []
    for x, y in batches:
        a.append(mg(x, labels=y).mean().item())
        logits, _ = nano(x, y)
        b.append(F.cross_entropy(logits.flatten(0, 1), y.flatten()).item())
    return np.array(a), np.array(b)


def same_start_trajectory(nanogpt: Path, train_bin: Path, args: argparse.Namespace, steps: int) -> None:
    """Both models from the same initial weights on the same batches, in this process, ``steps`` steps.

    mg's GPTModel (seed 1337) is copied into nanoGPT's GPT (its fused qkv rows reordered from mg's
    per-head [q_h, k_h, v_h] to nanoGPT's [q | k | v]); mg trains through its DDP wrapper and
    MegatronStyleOptimizer, nanoGPT through its own ``configure_optimizers`` AdamW and
    ``clip_grad_norm_``, both at the schedule of the main comparison. Linear biases are on for both
    here (bias=True), because mg's LayerNorm always has a bias and nanoGPT's only with bias=True: the
    two architectures are then identical parameter for parameter. Prints the largest per-step loss
    difference and the final largest weight difference.
    """
    from mg_models import GPTConfig as MgConfig
    from mg_models import GPTModel
    from mg_parallel.distributed import DistributedDataParallel, finalize_model_grads
    from mg_parallel.grid import ProcessGrid
    from mg_parallel.optimizer import OptimizerConfig, build_optimizer

    if str(nanogpt) not in sys.path:
        sys.path.insert(0, str(nanogpt))
    from model import GPT, GPTConfig

    s = SHAPES[args.shape]
    heads, hidden, seq = s["n_head"], s["n_embd"], args.seq
    cfg = MgConfig(num_layers=s["n_layer"], num_attention_heads=heads, hidden_size=hidden, vocab_size=args.vocab,
                   max_position_embeddings=seq, add_bias_linear=True)
    mg = GPTModel(cfg, seed=1337)
    with contextlib.redirect_stdout(io.StringIO()):
        nano = GPT(GPTConfig(block_size=seq, vocab_size=args.vocab, bias=True, dropout=0.0, **s))
    d = hidden // heads
    src = {k: v.detach().clone() for k, v in mg.state_dict().items()}
    dst = {"transformer.wte.weight": src["embedding.word_embeddings.weight"],
           "transformer.wpe.weight": src["embedding.position_embeddings.weight"],
           "transformer.ln_f.weight": src["decoder.final_layernorm.weight"],
           "transformer.ln_f.bias": src["decoder.final_layernorm.bias"]}
    for i in range(s["n_layer"]):
        a, b = f"decoder.layers.{i}.", f"transformer.h.{i}."
        qkv_w = src[a + "self_attention.linear_qkv.weight"].view(heads, 3, d, hidden).transpose(0, 1)
        qkv_b = src[a + "self_attention.linear_qkv.bias"].view(heads, 3, d).transpose(0, 1)
        dst |= {b + "attn.c_attn.weight": qkv_w.reshape(3 * hidden, hidden), b + "attn.c_attn.bias": qkv_b.reshape(-1)}
        for mine, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2"),
                             ("self_attention.linear_proj", "attn.c_proj"), ("mlp.linear_fc1", "mlp.c_fc"),
                             ("mlp.linear_fc2", "mlp.c_proj")):
            for t in ("weight", "bias"):
                dst[f"{b}{theirs}.{t}"] = src[f"{a}{mine}.{t}"]
    dst["lm_head.weight"] = dst["transformer.wte.weight"]
    missing = set(nano.state_dict()) - set(dst) - {k for k in nano.state_dict() if k.endswith(".attn.bias")}
    assert not missing, f"weights not mapped: {sorted(missing)}"
    nano.load_state_dict(dst, strict=False)
    grid = ProcessGrid.single()
    ddp = DistributedDataParallel(mg, grid)
    opt = build_optimizer([ddp], grid, OptimizerConfig(lr=LR, weight_decay=WD, adam_beta1=BETAS[0],
                                                       adam_beta2=BETAS[1], adam_eps=1e-8, clip_grad=CLIP))
    with contextlib.redirect_stdout(io.StringIO()):
        nano_opt = nano.configure_optimizers(WD, LR, BETAS, "cpu")
    data = torch.from_numpy(np.fromfile(train_bin, dtype=np.uint16).astype(np.int64))
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for it in range(steps):
        lr = nanogpt_lr(it, args.warmup - 1, args.iters - 1)  # = mg's lr at iteration it + 1 (checked above)
        ix = torch.randint(data.numel() - seq - 1, (args.micro,), generator=gen)
        x = torch.stack([data[i:i + seq] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + seq] for i in ix])
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad()
        loss_mg = ddp(x, labels=y).mean()
        loss_mg.backward()
        finalize_model_grads([ddp], grid)
        opt.step()
        for g in nano_opt.param_groups:
            g["lr"] = lr
        _, loss_nano = nano(x, y)
        loss_nano.backward()
        torch.nn.utils.clip_grad_norm_(nano.parameters(), CLIP)
        nano_opt.step()
        nano_opt.zero_grad(set_to_none=True)
        worst = max(worst, abs(loss_mg.item() - loss_nano.item()))
    w_mg = mg.state_dict()["embedding.word_embeddings.weight"]
    w_nano = nano.state_dict()["transformer.wte.weight"]
    print(f"  same start, same batches ({steps} steps of {args.micro} x {seq} tokens, bias=True on both, in one "
          f"process): largest |loss mg - loss nanoGPT| over the steps {worst:.2e}; last loss mg {loss_mg.item():.5f}, "
          f"nanoGPT {loss_nano.item():.5f}; largest word-embedding difference at the end "
          f"{(w_mg - w_nano).abs().max().item():.2e}", flush=True)


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def bench_models(work: Path, args: argparse.Namespace, prefix: Path, tok: Path, nano_data: Path) -> None:
    from mg_models import GPTConfig, flops_per_token, get_config

    nanogpt = Path(args.nanogpt).resolve()
    shape, seq, micro = args.shape, args.seq, args.micro
    if shape.startswith("gpt-"):
        model_cfg = get_config(shape, max_position_embeddings=seq, vocab_size=args.vocab, add_bias_linear=args.bias)
    else:
        s = SHAPES[shape]
        model_cfg = GPTConfig(num_layers=s["n_layer"], num_attention_heads=s["n_head"], hidden_size=s["n_embd"],
                              vocab_size=args.vocab, max_position_embeddings=seq, add_bias_linear=args.bias)
    fpt = flops_per_token(model_cfg, seq)
    interval = args.eval_interval or args.iters
    common = dict(shape=shape, seq=seq, micro=micro, iters=args.iters, warmup=args.warmup, eval_interval=interval,
                  eval_iters=args.eval_iters, threads=args.threads, bias=args.bias)
    batches = val_windows(nano_data / "val.bin", seq, micro)
    points = list(range(interval, args.iters + 1, interval))
    p32, p16 = matmul_peak(torch.float32, args.threads), matmul_peak(torch.bfloat16, args.threads)
    print(f"  matmul 1024^3 at {args.threads} threads: fp32 {p32 / 1e9:.1f} GFLOP/s, bf16 {p16 / 1e9:.2f} GFLOP/s "
          f"({p16 / p32:.3f}x fp32): " + ("no native bf16 matmul on this CPU, so only fp32 is compared"
                                          if p16 < 0.5 * p32 else "bf16 is usable here (this script compares fp32)"),
          flush=True)
    if args.same_start_steps:
        torch.set_num_threads(args.threads)
        same_start_trajectory(nanogpt, nano_data / "train.bin", args, args.same_start_steps)
    peaks, ratios, rows = [], [], {k: [] for k in points}
    mg_steps, nano_steps = [], []
    for r in range(args.repeats):
        seed = args.first_seed + r
        peaks.append(matmul_peak(torch.float32, args.threads))
        if args.concurrent:  # both at once: each sees the same machine load
            with ThreadPoolExecutor(2) as pool:
                fm = pool.submit(run_mg, work, f"mg-{r}", prefix, tok, split=args.split, seed=seed, **common)
                fn = pool.submit(run_nanogpt, work, f"nano-{r}", nanogpt, nano_data, seed=seed, **common)
                m, n = fm.result(), fn.result()
        else:
            m = run_mg(work, f"mg-{r}", prefix, tok, split=args.split, seed=seed, **common)
            n = run_nanogpt(work, f"nano-{r}", nanogpt, nano_data, seed=seed, **common)
        lr_err = max(abs(a - b) for a, b in zip(m["lr"], n["lr"], strict=True))
        ms, ns = med(m["times"][args.skip:]), med(n["times"][args.skip:])
        mg_steps.append(ms)
        nano_steps.append(ns)
        ratios.append(ns / ms)
        print(f"  seed {seed}: step mg {ms * 1e3:.0f} ms, nanoGPT {ns * 1e3:.0f} ms (nanoGPT/mg {ns / ms:.2f}x); "
              f"wall mg {m['wall']:.0f} s, nanoGPT {n['wall']:.0f} s; max |lr mg - lr nanoGPT| {lr_err:.1e}; "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
        q = max(1, args.iters // 4)
        print(f"    mean training loss over the last {q} iterations (different random batches): mg "
              f"{statistics.mean(m['losses'][-q:]):.4f}, nanoGPT {statistics.mean(n['losses'][-q:]):.4f}", flush=True)
        torch.set_num_threads(args.threads)
        for k in points:
            a, b = paired_eval(m["ckpt"] / f"iter_{k:07d}", n["ckpt"] / f"ckpt_{k}.pt", nanogpt, batches)
            d = a - b
            se = d.std(ddof=1) / math.sqrt(len(d))
            rows[k].append((a.mean(), b.mean(), d.mean(), se, m["vals"].get(k, math.nan), n["vals"].get(k, math.nan)))
            print(f"    after {k * micro * seq:7d} tokens (iter {k:4d}): val mg {a.mean():.4f}, nanoGPT {b.mean():.4f}, "
                  f"mg - nanoGPT {d.mean():+.4f} +- {se:.4f} (SE over {len(d)} batches) | own evals: mg "
                  f"{m['vals'].get(k, math.nan):.4f} ({args.eval_iters} batches), nanoGPT "
                  f"{n['vals'].get(k, math.nan):.4f} ({args.eval_iters} random batches)", flush=True)
    peak = med(peaks)
    tok_step = micro * seq
    print(f"{shape} ({model_cfg.num_layers} layers, {model_cfg.num_attention_heads} heads, hidden "
          f"{model_cfg.hidden_size}, vocabulary {args.vocab}, bias {args.bias}; {fpt / 1e6:.1f} MFLOP/token), seq {seq}, micro-batch "
          f"{micro}, {args.iters} iters (first {args.skip} and nanoGPT's evaluation steps untimed), warm-up "
          f"{args.warmup}, cosine {LR:g} -> {MIN_LR:g}, {args.threads} threads, {args.repeats} seeds "
          f"{'(mg and nanoGPT side by side)' if args.concurrent else 'interleaved'}; "
          f"fp32 matmul peak {peak / 1e9:.1f} GFLOP/s")
    for name, st in (("nanoGPT", nano_steps), ("mg", mg_steps)):
        s = med(st)
        print(f"  {name:8s}: {s * 1e3:7.1f} ms/iter, {tok_step / s:6.0f} tokens/s, MFU {fpt * tok_step / s / peak:.3f}")
    print(f"  speed vs nanoGPT (median of per-seed ratios of nanoGPT/mg step time): "
          f"{med(ratios):.2f}x ({', '.join(f'{x:.2f}' for x in ratios)}; target >= 1.0)")
    print(f"  validation loss on all {len(batches)} x {micro} non-overlapping {seq}-token windows of val.bin, both "
          f"models on the same windows (mean over seeds; SE = standard error of the paired difference over batches):")
    for k in points:
        rs = rows[k]
        dm = statistics.mean(x[2] for x in rs)
        se = math.sqrt(sum(x[3] ** 2 for x in rs)) / len(rs)
        spread = ""
        if len(rs) > 1:
            seed_se = statistics.stdev(x[2] for x in rs) / math.sqrt(len(rs))
            spread = f"; over seeds +- {seed_se:.4f} (per seed {', '.join(f'{x[2]:+.4f}' for x in rs)})"
        print(f"    {k * tok_step:8d} tokens: mg {statistics.mean(x[0] for x in rs):.4f}, nanoGPT "
              f"{statistics.mean(x[1] for x in rs):.4f}, mg - nanoGPT {dm:+.4f} +- {se:.4f} over batches{spread}")
    print("", flush=True)


def bench_dp(work: Path, args: argparse.Namespace, prefix: Path, tok: Path) -> None:
    """dp=2 (2 processes x 1 thread) against 1 process x 2 threads and 1 process x 1 thread, same global batch.

    Efficiency = t(1 process x 2 threads) / t(2 processes x 1 thread) (the target's definition) and,
    as a check that does not depend on how well one process uses two intra-op threads on a loaded
    machine, t(1 process x 1 thread) / (2 x t(2 processes x 1 thread)) (1.0 = perfect scaling).
    """
    common = dict(shape=args.dp_shape, seq=args.dp_seq, micro=args.dp_micro, iters=args.dp_iters,
                  warmup=min(args.warmup, args.dp_iters), eval_interval=0, eval_iters=0, split=args.split, bias=False,
                  global_batch=2 * args.dp_micro, save=False)
    skip = min(args.skip, args.dp_iters - 2)
    eff, eff1 = [], []
    for r in range(args.dp_repeats):
        load0 = os.getloadavg()[0]
        one = med(run_mg(work, f"dp1-{r}", prefix, tok, threads=2, nproc=1, **common)["times"][skip:])
        two = med(run_mg(work, f"dp2-{r}", prefix, tok, threads=1, nproc=2, **common)["times"][skip:])
        single = med(run_mg(work, f"dp1t-{r}", prefix, tok, threads=1, nproc=1, **common)["times"][skip:])
        eff.append(one / two)
        eff1.append(single / (2 * two))
        print(f"  dp repeat {r}: 1 proc x 2 threads {one * 1e3:.0f} ms/it, 2 procs x 1 thread {two * 1e3:.0f} ms/it, "
              f"1 proc x 1 thread {single * 1e3:.0f} ms/it; efficiency {eff[-1]:.2f} (vs 1x2), {eff1[-1]:.2f} "
              f"(vs 1x1 / 2) | load average (1 min) {load0:.1f} before, {os.getloadavg()[0]:.1f} after", flush=True)
    print(f"dp=2 ({args.dp_shape}, fp32, seq {args.dp_seq}, global batch {2 * args.dp_micro} = 2 x micro "
          f"{args.dp_micro}, {args.dp_iters} iters, {skip} skipped): efficiency 1x2 / 2x1 per repeat "
          f"{', '.join(f'{e:.2f}' for e in eff)} (median {med(eff):.2f}; target >= 0.85); 1x1 / (2 x 2x1) "
          f"{', '.join(f'{e:.2f}' for e in eff1)} (median {med(eff1):.2f})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nanogpt", help="path of a karpathy/nanoGPT checkout (omit: the comparison is skipped)")
    ap.add_argument("--shape", default="nano-cpu", choices=sorted(SHAPES), help="model shape of the comparison")
    ap.add_argument("--seq", type=int, default=64, help="sequence length (nanoGPT block_size)")
    ap.add_argument("--micro", type=int, default=12, help="micro-batch = batch (no gradient accumulation)")
    ap.add_argument("--vocab", type=int, default=4096, help="tokenizer vocabulary size")
    ap.add_argument("--bias", action=argparse.BooleanOptionalAction, default=True,
                    help="linear and LayerNorm biases on both (mg's LayerNorm always has one; nanoGPT's only with bias)")
    ap.add_argument("--iters", type=int, default=300, help="training iterations per run")
    ap.add_argument("--skip", type=int, default=5, help="warm-up iterations left out of the step time")
    ap.add_argument("--warmup", type=int, default=20, help="learning-rate warm-up iterations (mg's count, >= 1)")
    ap.add_argument("--eval-interval", type=int, default=75, help="iterations between validation points (0: end)")
    ap.add_argument("--eval-iters", type=int, default=4, help="batches of each side's own evaluation")
    ap.add_argument("--repeats", type=int, default=2, help="seeds: each runs mg then nanoGPT")
    ap.add_argument("--same-start-steps", type=int, default=50,
                    help="steps of the same-initial-weights, same-batches check (0: skip)")
    ap.add_argument("--first-seed", type=int, default=1337, help="seed of the first repeat (nanoGPT's own is 1337)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of every single-process run")
    ap.add_argument("--concurrent", action="store_true",
                    help="run each seed's mg and nanoGPT trainings at the same time (use with --threads 1)")
    ap.add_argument("--dp-shape", default="gpt-14m", choices=sorted(SHAPES), help="model of the dp comparison")
    ap.add_argument("--dp-seq", type=int, default=256)
    ap.add_argument("--dp-micro", type=int, default=8)
    ap.add_argument("--dp-iters", type=int, default=8, help="iterations of each data-parallel run (0: skip)")
    ap.add_argument("--dp-repeats", type=int, default=2, help="interleaved repeats of the data-parallel pair")
    ap.add_argument("--dp-only", action="store_true", help="only the data-parallel comparison")
    ap.add_argument("--corpus-mb", type=float, default=2.0)
    ap.add_argument("--split", default="90,10,0")
    args = ap.parse_args()
    if args.nanogpt is None and not args.dp_only:
        print("bench_train: skipped the nanoGPT comparison: pass --nanogpt PATH (a karpathy/nanoGPT checkout); "
              "--dp-only runs only the data-parallel part")
        return
    if args.nanogpt is not None and not (Path(args.nanogpt) / "train.py").is_file():
        sys.exit(f"--nanogpt {args.nanogpt}: no train.py there; pass the root of a karpathy/nanoGPT checkout")
    if args.warmup < 1 or (args.eval_interval and args.iters % args.eval_interval):
        sys.exit("--warmup must be >= 1 and --eval-interval must divide --iters")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()}", flush=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        work = Path(tmp)
        prefix, tok, nano_data = build_data(work, args.corpus_mb, args.split, args.vocab)
        if not args.dp_only:
            bench_models(work, args, prefix, tok, nano_data)
        if args.dp_iters > 0:
            bench_dp(work, args, prefix, tok)
    print(f"total {time.perf_counter() - t0:.0f} s, load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
