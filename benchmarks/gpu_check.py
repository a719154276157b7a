"""GPU readiness check: one run on a machine with NVIDIA GPUs, at most 8 minutes, written to OUT/gpu_check.json.

    bash benchmarks/gpu_check.sh              # on the GPU machine (OUT defaults to ./gpu_check_out)
    bash benchmarks/gpu_check.sh --dry-run    # the same steps with tiny shapes on the CPU, under 2 minutes

Parts, each a subprocess of this script with its own time limit (a part that hangs or crashes is recorded as
``timeout``/``failed`` with the end of its stderr, and the parts after it still run):

* ``unit``: the unit-test files that mention CUDA (``grep -rln cuda tests/``, not ``tests/e2e``), run with the
  GPU visible (multi-rank tests with fewer GPUs than ranks run on the CPU, as ``run_distributed`` does).
* ``checkpoint``: mg-ckpt save/load of a device-resident state against a raw write/read of the same bytes
  (host copy + one file + fsync; read into host memory + copy to the device), the round trip compared bit for
  bit, and an asynchronous save with a side-stream snapshot that must not see a later in-place update.
* ``generate``: mg's ``generate`` against Hugging Face ``generate`` on the same Llama-1B-shaped model (bf16),
  batch 1 and 32, greedy.
* ``multi_gpu``: with 2 or more GPUs, ``mg train`` at tp2 and dp2 (NCCL) against one GPU: loss and grad_norm
  at every iteration, and tokens/s.
* ``train``: ``mg train`` in bf16 of GPT-1.3B (24 layers, hidden 2048, 16 heads, seq 2048, vocabulary 50257
  padded to 50304) and of a Llama-3.2-1B shape (16 layers, hidden 2048, 32 heads, 8 KV groups, SwiGLU 8192,
  RoPE, RMSNorm, tied embeddings, vocabulary 128256) on random token ids: the micro-batch searched eagerly
  (1, 2, 4, 8 until out of memory or no gain), then compiled (``train.compile``) and with recompute at the
  best one. Runs last, with what the 8-minute budget leaves.

``--dry-run`` runs every part on the CPU (gloo for ``multi_gpu``, fp32) with tiny models with the same keys, so
a mistake in a part's set-up shows here rather than in the one GPU run; it compiles the Llama stand-in only (a
CPU compile takes 20-40 s). Figures of a dry run measure nothing.
The exit status is 1 when any part failed or timed out; the JSON is written after every part either way.
Targets (checkpoint and generation ratios) are recorded as met or not; they do not fail a part.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PUBLISHED_PEAK_TFLOPS = 989.0  # H100/H200 SXM, dense bf16 (what mg train's MFU divides by there)
BUDGET_S = 480.0  # a GPU run, all parts
LIMIT_S = {  # part: (GPU run, dry run); on a GPU train runs last, with at most this and what the budget leaves.
    # A dry run checks the set-up, not the speed: its limits leave room for a CPU shared with other jobs (CI).
    "unit": (60, 60), "checkpoint": (40, 60), "generate": (60, 90), "multi_gpu": (60, 120), "train": (330, 360),
}
ORDER = ("unit", "checkpoint", "generate", "multi_gpu", "train")
DRY_UNIT = ("tests/mg_parallel/test_device.py",)  # a few seconds on a CPU
MARKER = "MG_RUN_ID"  # mg train's own job marker; every process started here carries one of ours

# --- processes ---------------------------------------------------------------------------------------------


def stop_marked(prefix: str) -> None:
    """SIGKILL every process whose environment holds ``MG_RUN_ID=<prefix>...`` (what a run left behind: its
    launcher runs in a session of its own, so the run's process group does not reach it)."""
    needle = f"{MARKER}={prefix}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                hit = any(e.startswith(needle) for e in f.read().split(b"\0"))
            if hit:
                os.kill(int(pid), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


def tail(path: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of a log file ('' if there is none)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@dataclass
class Run:
    """One finished subprocess: ``status`` is passed, failed, oom or timeout."""

    status: str
    seconds: float
    out: Path
    err: Path

    @property
    def error(self) -> str:
        return tail(self.err) or tail(self.out)


def run_limited(cmd: list[str], timeout: float, log: Path, env: dict[str, str]) -> Run:
    """Run ``cmd`` from the repository root with output in ``log``.out/.err; after ``timeout`` seconds it and
    everything it started (found by ``env[MG_RUN_ID]``) are killed."""
    log.parent.mkdir(parents=True, exist_ok=True)
    out, err = log.parent / f"{log.name}.out", log.parent / f"{log.name}.err"
    t = time.monotonic()
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fo, stderr=fe, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            rc = None
        stop_marked(env[MARKER])
        proc.wait()
    seconds = time.monotonic() - t
    if rc is None:
        return Run("timeout", seconds, out, err)
    if rc == 0:
        return Run("passed", seconds, out, err)
    oom = "out of memory" in tail(err, 200).lower()  # torch.OutOfMemoryError: CUDA out of memory ...
    return Run("oom" if oom else "failed", seconds, out, err)


@dataclass
class Ctx:
    """What a part gets: the mode, where to write, its deadline (``time.monotonic()``) and its process marker."""

    name: str
    dry: bool
    out: Path
    deadline: float
    marker: str
    gpus: int

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self, result: dict) -> None:
        """Write the part's result so far (read by the driver even if the part is killed later)."""
        path = self.out / "parts" / f"{self.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(path)

    def run(self, tag: str, cmd: list[str], timeout: float) -> Run:
        env = {**os.environ, MARKER: f"{self.marker}.{tag}", "PYTHONUNBUFFERED": "1",
               "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "10"}
        return run_limited(cmd, min(timeout, self.left()), self.out / "logs" / self.name / tag, env)

    def mg(self, tag: str, args: list[str], log_dir: Path, timeout: float) -> Run:
        """``mg train ARGS`` logging to ``log_dir``, emptied first (metrics.jsonl is appended to)."""
        shutil.rmtree(log_dir, ignore_errors=True)
        return self.run(tag, [sys.executable, "-m", "mg_cli.main", *args], timeout)


# --- unit ------------------------------------------------------------------------------------------------


def files_mentioning_cuda() -> list[str]:
    """``grep -rln cuda tests/ --include=*.py`` without the end-to-end tests, sorted, relative to the repository."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("*.py")
                  if p.relative_to(REPO / "tests").parts[0] != "e2e" and "cuda" in p.read_text())


def part_unit(ctx: Ctx) -> dict:
    found = files_mentioning_cuda()
    files = list(DRY_UNIT) if ctx.dry else found
    if not files:  # pytest without paths would run the whole suite
        return {"status": "failed", "error": "no unit-test file mentions cuda"}
    r = ctx.run("pytest", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files], ctx.left())
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    for n, kind in re.findall(r"(\d+) (passed|failed|skipped|error)", tail(r.out, 3)):  # pytest's summary line
        counts["errors" if kind == "error" else kind] = int(n)
    ok = r.status == "passed" and counts["passed"] > 0
    res = {"status": "passed" if ok else "failed", "files": files, "found_by_grep": found, "figures": counts,
           "summary": [tail(r.out, 1)]}
    return res if ok else {**res, "error": tail(r.out, 40)}


# --- data for mg train ---------------------------------------------------------------------------------------


def word_tokenizer(path: Path, vocab: int) -> Path:
    """A Hugging Face tokenizer.json of ``vocab`` whitespace-separated words ``t0 t1 ...``, ``<|endoftext|>``
    last: mg train takes its vocabulary from the tokenizer, and the data below is token ids already."""
    import tokenizers

    words = {f"t{i}": i for i in range(vocab - 2)} | {"<unk>": vocab - 2, "<|endoftext|>": vocab - 1}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


def token_data(root: Path, vocabs: set[int], docs: int) -> tuple[Path, dict[int, Path]]:
    """Random token ids (below every vocabulary in ``vocabs``) as an mg dataset of ``docs`` 8192-token
    documents, and a tokenizer per vocabulary."""
    import numpy as np

    from mg_data.indexed import IndexedDatasetBuilder

    root.mkdir(parents=True, exist_ok=True)
    prefix = root / "random_text_document"
    with IndexedDatasetBuilder(str(prefix), np.int32, durable=False) as b:
        lens = np.full(docs, 8192)
        ids = np.random.default_rng(0).integers(0, min(vocabs) - 2, size=int(lens.sum()), dtype=np.int32)
        b.add_batch(ids, lens)
    return prefix, {v: word_tokenizer(root / f"tokenizer{v}.json", v) for v in vocabs}


def train_args(model: dict[str, Any], data: tuple[Path, dict[int, Path]], vocab: int, log_dir: Path,
               sets: list[str]) -> list[str]:
    """``mg train`` arguments: the model's keys, the synthetic data, logging every iteration, no evaluation."""
    prefix, tokenizers = data
    keys = [f"model.{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in model.items()]
    keys += ["eval.iters=0", "log.interval=1", "data.num_workers=0", f"data.path={prefix}",
             f"data.tokenizer_model={tokenizers[vocab]}", f"log.dir={log_dir}", *sets]
    return ["train", *[a for k in keys for a in ("--set", k)]]


def read_records(log_dir: Path) -> tuple[dict, list[dict]]:
    """The start record and the training-step records of a run's metrics.jsonl."""
    path = log_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    start = next((r for r in records if r.get("event") == "start"), {})
    return start, [r for r in records if "loss" in r and "iteration" in r]


def step_figures(log_dir: Path, skip: int) -> dict:
    """Medians over the steps after the first ``skip`` and the steps that compiled (the keys of mg train's
    metrics records), peak memory, compile time, and the peak the MFU is relative to."""
    start, steps = read_records(log_dir)
    measured = [r for r in steps if r["iteration"] > skip and "compile_s" not in r]
    if not measured:
        raise ValueError(f"{log_dir}: no measured iteration among {len(steps)} logged (first {skip} skipped)")
    med = {k: statistics.median(r[k] for r in measured) for k in ("tokens_per_s", "tflops_per_device", "mfu",
                                                                  "step_time_s")}
    peak = [r["mfu_peak_tflops_per_device"] for r in [start, *steps] if "mfu_peak_tflops_per_device" in r]
    return {**med, "iterations_measured": [r["iteration"] for r in measured],
            "peak_mem_gib": max(r["peak_mem_bytes"] for r in steps) / 2**30,
            "compile_s": sum(r.get("compile_s", 0.0) for r in steps) or None, "final_loss": steps[-1]["loss"],
            "mfu_peak_tflops": peak[-1] if peak else None, "mfu_peak_source": start.get("mfu_peak_source"),
            "settings": start.get("settings"), "paths": start.get("paths")}


# --- train ------------------------------------------------------------------------------------------------------

GPT_1P3B = {"preset": "gpt2-medium", "num_layers": 24, "hidden_size": 2048, "num_attention_heads": 16}
LLAMA_1B = {"preset": "llama-7b", "num_layers": 16, "hidden_size": 2048, "num_attention_heads": 32,
            "num_query_groups": 8, "ffn_hidden_size": 8192, "rotary_base": 500000.0, "tie_word_embeddings": True}
TINY = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64}  # same keys, tiny values
TRAIN_MODELS = {  # name: (model keys, tokenizer vocabulary), on a GPU and in a dry run
    False: {"gpt-1.3b": ({**GPT_1P3B, "seq_length": 2048}, 50257),
            "llama-1b": ({**LLAMA_1B, "seq_length": 2048}, 128256)},
    True: {"gpt-1.3b": ({**GPT_1P3B, **TINY}, 512),
           "llama-1b": ({**LLAMA_1B, **TINY, "num_query_groups": 2, "ffn_hidden_size": 160}, 512)},
}
TRAIN_PLAN = {  # micro-batches tried, global batch, iterations (eager, compiled), first iterations skipped,
    # precision; time cap of one eager / compiled run, and the time a run needs left to be started
    False: dict(micro_batches=(1, 2, 4, 8), global_batch=8, iters=(6, 8), skip=2, precision="bf16", cap=(75, 180),
                needs=(25, 90)),
    True: dict(micro_batches=(1, 2), global_batch=2, iters=(4, 4), skip=2, precision="fp32", cap=(120, 200),
               needs=(10, 20)),
}
MIN_GAIN = 1.03  # the search stops when a larger micro-batch gains less than this in tokens/s
DRY_COMPILED = "llama-1b"  # a dry run compiles one model: a CPU compile takes ~20 s (test_train_compile covers GPT-2)


def parameters(model: dict[str, Any], vocab: int) -> int:
    from mg_models import get_config, num_parameters

    fields = {k: v for k, v in model.items() if k not in ("preset", "seq_length")}
    return num_parameters(get_config(model["preset"], **fields, vocab_size=vocab,
                                     max_position_embeddings=model["seq_length"]))


def train_run(ctx: Ctx, data: tuple, name: str, tag: str, mb: int, sets: list[str], compiled: bool = False) -> dict:
    """One ``mg train`` of ``name`` at micro-batch ``mb``; its figures, or its status and error."""
    plan = TRAIN_PLAN[ctx.dry]
    model, vocab = TRAIN_MODELS[ctx.dry][name]
    log_dir = ctx.out / "runs" / f"{name}-{tag}-mb{mb}"
    args = train_args(model, data, vocab, log_dir, [
        f"train.micro_batch_size={mb}", f"train.global_batch_size={plan['global_batch']}",
        f"train.iters={plan['iters'][compiled]}", f"train.precision={plan['precision']}", *sets])
    r = ctx.mg(f"{name}-{tag}-mb{mb}", args, log_dir, plan["cap"][compiled])
    res: dict[str, Any] = {"micro_batch": mb, "status": r.status, "seconds": round(r.seconds, 1)}
    if r.status != "passed":
        return {**res, "error": r.error}
    try:
        return {**res, **step_figures(log_dir, plan["skip"])}
    except (ValueError, KeyError) as e:
        return {**res, "status": "failed", "error": str(e)}


def search_micro_batch(ctx: Ctx, data: tuple, name: str) -> dict:
    """Eager runs at growing micro-batches until one runs out of memory, fails, or gains < MIN_GAIN."""
    tried, best, stop = [], None, "all sizes tried"
    for mb in TRAIN_PLAN[ctx.dry]["micro_batches"]:
        if ctx.left() < TRAIN_PLAN[ctx.dry]["needs"][False]:
            stop = "time limit of the part reached"
            break
        r = train_run(ctx, data, name, "eager", mb, [])
        tried.append(r)
        if r["status"] != "passed":
            stop = "out of memory" if r["status"] == "oom" else r["status"]
            break
        gain = r["tokens_per_s"] / best["tokens_per_s"] if best else None
        if best is None or gain > 1:
            best = r
        if gain is not None and gain < MIN_GAIN:
            stop = f"micro-batch {mb} gains {gain:.3f}x"
            break
    failed = best is None or any(t["status"] in ("failed", "timeout") for t in tried)
    return {**(best or {}), "status": "failed" if failed else "passed", "stopped": stop, "search": tried}


def variant(ctx: Ctx, data: tuple, name: str, eager: dict, tag: str, sets: list[str], compiled: bool) -> dict:
    """A run at the eager search's micro-batch with ``sets``; its tokens/s also as a ratio to eager's."""
    if eager["status"] != "passed":
        return {"status": "skipped", "reason": "the eager micro-batch search did not pass"}
    if ctx.left() < TRAIN_PLAN[ctx.dry]["needs"][compiled]:
        return {"status": "skipped", "reason": "time limit of the part reached"}
    r = train_run(ctx, data, name, tag, eager["micro_batch"], sets, compiled)
    if r["status"] == "passed":
        r["vs_eager"] = r["tokens_per_s"] / eager["tokens_per_s"]
    return r


def part_train(ctx: Ctx) -> dict:
    models = TRAIN_MODELS[ctx.dry]
    data = token_data(ctx.out / "data", {v for _, v in models.values()}, 16 if ctx.dry else 256)
    res: dict[str, Any] = {"status": "passed", "plan": TRAIN_PLAN[ctx.dry], "models": {}}
    for name, (model, vocab) in models.items():
        res["models"][name] = {"keys": model, "vocab_size": vocab, "parameters": parameters(model, vocab)}
        res["models"][name]["eager"] = search_micro_batch(ctx, data, name)
        ctx.save(res)
    granularity, note = "selective", None
    for name, m in res["models"].items():
        r = variant(ctx, data, name, m["eager"], f"recompute-{granularity}",
                    [f"parallel.recompute_granularity={granularity}"], False)
        if granularity == "selective" and "selective is not supported" in r.get("error", ""):
            granularity, note = "full", r["error"].splitlines()[-1]
            r = variant(ctx, data, name, m["eager"], "recompute-full", ["parallel.recompute_granularity=full"], False)
        m["recompute"] = {**r, "granularity": granularity, **({"note": f"selective: {note}"} if note else {})}
        ctx.save(res)
    for name, m in res["models"].items():
        if ctx.dry and name != DRY_COMPILED:
            m["compiled"] = {"status": "skipped", "reason": f"dry run: only {DRY_COMPILED} is compiled (a CPU "
                                                           "compile takes ~20 s per model)"}
            continue
        m["compiled"] = r = variant(ctx, data, name, m["eager"], "compiled", ["train.compile=true"], True)
        if r["status"] == "failed" and "unknown key 'train.compile'" in r["error"]:
            m["compiled"] = {"status": "skipped", "reason": f"mg train has no train.compile key: {r['error']}"}
        ctx.save(res)
    runs = {f"{n} {k}": m[k] for n, m in res["models"].items() for k in ("eager", "recompute", "compiled")}
    if any(v["status"] in ("failed", "timeout") for v in runs.values()):
        res["status"] = "failed"
    measured = [v for v in runs.values() if "mfu" in v]
    res["targets"] = {"mfu in (0, 1] in every run": {"met": bool(measured) and all(0 < v["mfu"] <= 1
                                                                                   for v in measured)}}
    if not ctx.dry:
        peaks = sorted({v["mfu_peak_tflops"] for v in measured})
        res["targets"][f"MFU of the published {PUBLISHED_PEAK_TFLOPS:.0f} TFLOP/s (H100/H200 SXM, bf16)"] = {
            "value": peaks, "met": bool(peaks) and all(abs(p - PUBLISHED_PEAK_TFLOPS) < 1e-6 for p in peaks)}
    res["summary"] = [train_line(k, v) for k, v in runs.items()]
    return res


def train_line(what: str, v: dict) -> str:
    what += f" {v['granularity']}" if "granularity" in v else ""
    if v["status"] != "passed":
        return f"{what}: {v['status']} {v.get('reason', '')}".rstrip()
    extra = f", {v['vs_eager']:.2f}x eager" if "vs_eager" in v else f" ({v['stopped']})"
    return (f"{what} mb {v['micro_batch']}: {v['tokens_per_s']:.0f} tok/s, {v['tflops_per_device']:.3g} "
            f"TFLOP/s, mfu {v['mfu']:.3f}, {v['peak_mem_gib']:.1f} GiB{extra}")


# --- checkpoint ----------------------------------------------------------------------------------------------


def part_checkpoint(ctx: Ctx) -> dict:
    import torch
    from bench_ckpt import interleaved, ratios

    from mg_ckpt import finalize, load_checkpoint, save_checkpoint, wait_for_snapshot

    device = torch.device("cpu" if ctx.dry else "cuda")
    nbytes, n = (8 << 20, 4) if ctx.dry else (1 << 30, 16)
    torch.manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(nbytes // (4 * n * 4096), 4096, device=device) for i in range(n)}
    total = sum(v.numel() * v.element_size() for v in state.values())
    gb = total / 1e9
    root = ctx.out / "ckpt_scratch"
    raw, save_dir = root / "raw.bin", root / "ckpt"
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    host = torch.zeros(total, dtype=torch.uint8)  # the raw read's target, touched as the load's template is
    template = {k: torch.zeros_like(v) for k, v in state.items()}
    it = iter(range(1, 10_000))

    def raw_write() -> None:  # the bytes copied to the host, one file, fsync
        with open(raw, "wb") as f:
            for v in state.values():
                f.write(memoryview(v.cpu().reshape(-1).numpy()).cast("B"))
            f.flush()
            os.fsync(f.fileno())

    def raw_read() -> None:  # into host memory, then onto the device
        with open(raw, "rb", buffering=0) as f:
            view, got = memoryview(host.numpy()), 0
            while got < len(view):
                got += f.readinto(view[got:])
        at = 0
        for v in template.values():
            size = v.numel() * v.element_size()
            v.view(-1).view(torch.uint8).copy_(host[at:at + size])
            at += size
        sync()

    def clean() -> None:
        shutil.rmtree(save_dir, ignore_errors=True)
        raw.unlink(missing_ok=True)
        os.sync()

    root.mkdir(parents=True, exist_ok=True)
    try:
        w = interleaved({"raw": raw_write, "save": lambda: save_checkpoint(str(save_dir), next(it), state)}, 3,
                        setup=clean)
        clean()
        raw_write()
        save_checkpoint(str(save_dir), next(it), state)
        r = interleaved({"raw": raw_read, "load": lambda: (load_checkpoint(str(save_dir), template, verify=False),
                                                           sync())}, 3)
        round_trip = all(torch.equal(template[k], state[k]) for k in state)
        # Asynchronous save, snapshot on a side stream into pinned memory; the update after the wait must not
        # reach the checkpoint.
        before = {k: v.clone() for k, v in state.items()}
        clean()
        t = time.perf_counter()
        handle = save_checkpoint(str(save_dir), next(it), state, async_save=True, background_snapshot=True)
        call_s = time.perf_counter() - t
        wait_for_snapshot()
        for v in state.values():
            v.add_(1.0)
        handle.wait()
        finalize()
        load_checkpoint(str(save_dir), template, verify=True)
        async_ok = all(torch.equal(template[k], before[k]) for k in state)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    save_best, save_med = ratios(w, "raw", "save")
    load_best, load_med = ratios(r, "raw", "load")
    figures = {"state_gb": gb, "device": str(device), "raw_write_gbps": gb / min(w["raw"]),
               "save_gbps": gb / min(w["save"]), "save_vs_raw_write": save_best, "save_vs_raw_write_median": save_med,
               "raw_read_gbps": gb / min(r["raw"]), "load_gbps": gb / min(r["load"]), "load_vs_raw_read": load_best,
               "load_vs_raw_read_median": load_med, "async_save_call_s": call_s}
    checks = {"round_trip_bit_exact": round_trip, "async_snapshot_before_update": async_ok}
    return {"status": "passed" if all(checks.values()) else "failed", "figures": figures, "checks": checks,
            "targets": {"save >= 0.7x raw write": {"value": save_best, "met": save_best >= 0.7},
                        "load >= 0.7x raw read": {"value": load_best, "met": load_best >= 0.7}},
            "summary": [f"save {figures['save_gbps']:.2f} GB/s ({save_best:.2f}x raw write), load "
                        f"{figures['load_gbps']:.2f} GB/s ({load_best:.2f}x raw read); checks {checks}"]}


# --- generate ----------------------------------------------------------------------------------------------

GEN_SHAPE = {  # the Hugging Face Llama of each mode, and prompt / new tokens / timed repetitions
    False: dict(hf=dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0), prompt=128, new=64, reps=3),
    True: dict(hf=dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0), prompt=8, new=4, reps=1),
}
GEN_BATCHES = (1, 32)


def part_generate(ctx: Ctx) -> dict:
    import tempfile
    import warnings

    import torch
    import transformers

    from mg_models import load_pretrained
    from mg_models.generation import SamplingConfig, generate

    warnings.filterwarnings("ignore")
    spec = GEN_SHAPE[ctx.dry]
    device, dtype = (torch.device("cpu"), torch.float32) if ctx.dry else (torch.device("cuda"), torch.bfloat16)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**spec["hf"], max_position_embeddings=spec["prompt"] + spec["new"] + 64,
                                   tie_word_embeddings=True)
    with torch.device(device):
        hf = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
    with tempfile.TemporaryDirectory(dir=ctx.out) as d:
        hf.save_pretrained(d)
        mg = load_pretrained(d, dtype=dtype, device=device).eval()
    new, figures, gen = spec["new"], {}, torch.Generator().manual_seed(1)
    for batch in GEN_BATCHES:
        ids = torch.randint(0, cfg.vocab_size, (batch, spec["prompt"]), generator=gen)
        fns = {"hf": lambda ids=ids: hf.generate(ids.to(device), attention_mask=torch.ones_like(ids).to(device),
                                                  max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                                  pad_token_id=0)[:, ids.shape[1]:].tolist(),
               "mg": lambda ids=ids: generate(mg, ids.tolist(), SamplingConfig(max_new_tokens=new)).tokens}
        times: dict[str, list[float]] = {"hf": [], "mg": []}
        with torch.no_grad():
            tokens = {k: fn() for k, fn in fns.items()}  # warm-up
            for _ in range(spec["reps"]):
                for k, fn in fns.items():
                    sync()
                    t = time.perf_counter()
                    fn()
                    sync()
                    times[k].append(time.perf_counter() - t)
        rate = {k: batch * new / min(v) for k, v in times.items()}  # fastest run: the others measure foreign load
        same = sum(a == b for a, b in zip(tokens["hf"], tokens["mg"])) / batch
        figures[f"batch{batch}"] = {"hf_tokens_per_s": rate["hf"], "mg_tokens_per_s": rate["mg"],
                                    "mg_vs_hf": rate["mg"] / rate["hf"], "identical_rows": same}
    b1 = figures["batch1"]["mg_vs_hf"]
    return {"status": "passed", "model": {**spec["hf"], "dtype": str(dtype), "tie_word_embeddings": True},
            "prompt": spec["prompt"], "new_tokens": new, "figures": figures,
            "targets": {"batch 1 >= 1.5x Hugging Face": {"value": b1, "met": b1 >= 1.5}},
            "summary": [f"batch {b}: mg {f['mg_tokens_per_s']:.0f} tok/s, HF {f['hf_tokens_per_s']:.0f} tok/s, "
                        f"{f['mg_vs_hf']:.2f}x, identical rows {f['identical_rows']:.2f}"
                        for b, f in zip(GEN_BATCHES, figures.values())]}


# --- multi_gpu -----------------------------------------------------------------------------------------------

MULTI_PLAN = {  # model keys, vocabulary, --set values, relative tolerance of loss and grad_norm
    # bf16: loss 1e-3 and grad_norm 5e-3, the bounds tests/e2e/test_train_precision.py holds tp2 to in bf16.
    False: ({"preset": "gpt2-medium", "seq_length": 1024}, 50257,
            ["train.micro_batch_size=4", "train.global_batch_size=8", "train.iters=8", "train.precision=bf16"],
            {"loss": 1e-3, "grad_norm": 5e-3}),
    True: ({"preset": "gpt2-medium", **TINY}, 512,
           ["train.micro_batch_size=1", "train.global_batch_size=4", "train.iters=3", "train.precision=fp32"],
           {"loss": 1e-5, "grad_norm": 1e-5}),
}
LAYOUTS = {"1": (1, []), "tp2": (2, ["parallel.tp=2"]), "dp2": (2, [])}  # name: (processes, --set values)


def part_multi_gpu(ctx: Ctx) -> dict:
    if not ctx.dry and ctx.gpus < 2:
        return {"status": "skipped", "reason": f"{ctx.gpus} GPU", "summary": [f"skipped: {ctx.gpus} GPU"]}
    model, vocab, sets, tol = MULTI_PLAN[ctx.dry]
    data = token_data(ctx.out / "data_multi", {vocab}, 16 if ctx.dry else 64)
    res: dict[str, Any] = {"status": "passed", "model": model, "sets": sets, "tolerance": tol, "layouts": {}}
    steps: dict[str, dict[int, dict]] = {}
    for name, (nproc, extra) in LAYOUTS.items():
        log_dir = ctx.out / "runs" / f"multi-{name}"
        args = train_args(model, data, vocab, log_dir, [*sets, *extra])
        r = ctx.mg(f"multi-{name}", [*args, *(["--nproc-per-node", str(nproc)] if nproc > 1 else [])], log_dir, 40)
        lay: dict[str, Any] = {"status": r.status, "seconds": round(r.seconds, 1)}
        if r.status == "passed":
            steps[name] = {s["iteration"]: s for s in read_records(log_dir)[1]}
            rates = [s["tokens_per_s"] for s in steps[name].values()]
            lay["tokens_per_s"] = statistics.median(rates[2:] or rates)  # after the first two steps
        else:
            lay["error"] = r.error
            res["status"] = "failed"
        res["layouts"][name] = lay
        ctx.save(res)
    for name in ("tp2", "dp2"):
        lay = res["layouts"][name]
        if name not in steps or "1" not in steps:
            continue
        ref, got = steps["1"], steps[name]
        diff = {k: max(abs(got[i][k] - s[k]) / max(abs(s[k]), 1e-12) for i, s in ref.items() if i in got)
                for k in ("loss", "grad_norm")}
        lay["max_rel_diff"] = diff
        lay["parity"] = sorted(got) == sorted(ref) and all(diff[k] <= tol[k] for k in tol)
        lay["vs_1"] = lay["tokens_per_s"] / res["layouts"]["1"]["tokens_per_s"]
        if not lay["parity"]:
            res["status"] = "failed"
    res["summary"] = [layout_line(n, v) for n, v in res["layouts"].items()]
    return res


def layout_line(name: str, v: dict) -> str:
    line = f"{name}: {v['status']}" + (f", {v['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in v else "")
    if "parity" in v:
        d = v["max_rel_diff"]
        line += f" ({v['vs_1']:.2f}x), parity {v['parity']} (max rel: loss {d['loss']:.1e}, grad_norm {d['grad_norm']:.1e})"
    return line


PARTS: dict[str, Callable[[Ctx], dict]] = {"unit": part_unit, "checkpoint": part_checkpoint,
                                           "generate": part_generate, "multi_gpu": part_multi_gpu,
                                           "train": part_train}

# --- driver ------------------------------------------------------------------------------------------------


def environment(dry: bool) -> dict:
    """Commit, date, torch version and the devices (asked in a subprocess: this process never touches CUDA)."""
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True).stdout.strip()

    info = {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": importlib.metadata.version("torch"), "dry_run": dry}
    if dry:
        return {**info, "device": "cpu (dry run)", "device_count": 0}
    probe = ("import json, torch; n = torch.cuda.device_count(); print(json.dumps({'device': "
             "torch.cuda.get_device_name(0) if n else 'no CUDA device', 'device_count': n, 'cuda': torch.version.cuda}))")
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
        devices = json.loads(out.stdout) if out.returncode == 0 else {"device": out.stderr[-500:], "device_count": 0}
    except subprocess.TimeoutExpired:
        devices = {"device": "torch.cuda did not answer within 60 s", "device_count": 0}
    return {**info, **devices}


def run_part(name: str, args: argparse.Namespace, out: Path, limit: float, gpus: int, marker: str) -> dict:
    """Run one part as a subprocess with ``limit`` seconds; its result, or its partial result with the failure."""
    result_path = out / "parts" / f"{name}.json"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--out", str(out), "--limit-s", str(limit),
           "--gpus", str(gpus), *(["--dry-run"] if args.dry_run else [])]
    env = {**os.environ, MARKER: f"{marker}.{name}", "PYTHONUNBUFFERED": "1"}
    if args.dry_run:
        env.update(MG_FORCE_CPU="1", CUDA_VISIBLE_DEVICES="")
    r = run_limited(cmd, limit, out / "logs" / name, env)
    part = json.loads(result_path.read_text()) if result_path.exists() else {}
    if r.status != "passed":
        part = {**part, "status": "timeout" if r.status == "timeout" else "failed", "error": r.error}
    elif not part:
        part = {"status": "failed", "error": "the part wrote no result"}
    return {"status": part.pop("status"), "seconds": round(r.seconds, 1), "limit_s": round(limit), **part}


def print_table(report: dict) -> None:
    print(f"\ngpu_check {report['commit'][:10]}{' (dirty)' if report['dirty'] else ''} on {report['device']} "
          f"(x{report['device_count']}), torch {report['torch']}, {report['total_s']:.0f} s")
    print(f"{'part':<11} {'status':<8} {'seconds':>7}  figures")
    for name, p in report["parts"].items():
        error = (p.get("error") or "").strip().splitlines()
        lines = p.get("summary") or [p.get("reason") or (error[-1] if error else "")]
        if p["status"] in ("failed", "timeout") and error and p.get("summary"):
            lines = [*lines, error[-1]]
        for i, line in enumerate(lines):
            head = f"{name:<11} {p['status']:<8} {p['seconds']:>7.1f}" if i == 0 else " " * 28
            print(f"{head}  {line}")
        for t, v in p.get("targets", {}).items():
            print(f"{'':28}  target {t}: {'met' if v['met'] else 'NOT met'}")
    print(f"wrote {report['json']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: check every part's set-up")
    ap.add_argument("--only", default=",".join(ORDER), help=f"comma-separated parts to run (default: {','.join(ORDER)})")
    ap.add_argument("--out", default=None, help="output directory (default: $OUT, else ./gpu_check_out)")
    ap.add_argument("--part", choices=ORDER, help=argparse.SUPPRESS)  # one part, run by the driver
    ap.add_argument("--limit-s", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--gpus", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = Path(args.out or os.environ.get("OUT") or "gpu_check_out").resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.part:
        ctx = Ctx(args.part, args.dry_run, out, time.monotonic() + args.limit_s - 3, os.environ[MARKER], args.gpus)
        ctx.save(PARTS[args.part](ctx))
        return 0
    parts = [p for p in ORDER if p in args.only.split(",")]
    t0 = time.monotonic()
    report = {**environment(args.dry_run), "budget_s": None if args.dry_run else BUDGET_S, "parts": {},
              "json": str(out / "gpu_check.json")}
    marker = f"gpu-check-{uuid.uuid4().hex[:12]}"
    for name in parts:
        limit = LIMIT_S[name][args.dry_run]
        if name == "train" and not args.dry_run:
            limit = min(limit, BUDGET_S - (time.monotonic() - t0) - 5)
        if not args.dry_run and report["device_count"] == 0:
            report["parts"][name] = {"status": "failed", "seconds": 0.0,
                                     "error": f"torch sees no CUDA device ({report['device']}); on a CPU use --dry-run"}
        else:
            report["parts"][name] = run_part(name, args, out, limit, report["device_count"], marker)
        report["total_s"] = time.monotonic() - t0
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    report["total_s"] = time.monotonic() - t0
    report["failed"] = [n for n, p in report["parts"].items() if p["status"] in ("failed", "timeout")]
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print_table(report)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
