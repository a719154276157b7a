"""Shared end-to-end fixtures: a corpus from the standard library's sources, a tokenizer trained on
it, its preprocessed dataset, and a helper to run ``mg`` as users do (a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

from tests.e2e.zygote import Zygote, ZygoteProcess

REPO = Path(__file__).resolve().parents[2]


def stdlib_corpus(out: Path, max_bytes: int) -> Path:
    """JSONL of Python standard-library source files (sorted, so the corpus is deterministic)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    with open(out, "w") as f:
        for path in sorted(root.glob("*.py")):
            text = path.read_text(encoding="utf-8", errors="replace")
            f.write(json.dumps({"text": text}) + "\n")
            total += len(text)
            if total >= max_bytes:
                break
    return out


_ZYGOTE = Zygote()


def _mg_env(env: dict | None) -> dict[str, str]:
    """The environment of an ``mg`` command: this process's, unbuffered output, then ``env``."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}


def mg(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 600,
       check: bool = True, fresh: bool = False) -> subprocess.CompletedProcess:
    """Run ``python -m mg_cli.main ARGS`` as a process of its own and return it completed (text output).

    The process is forked from a server that has imported torch and mg already (see ``zygote.py``); ``fresh``
    starts a new interpreter instead."""
    full_env = _mg_env(env)
    if fresh:
        proc = subprocess.run([sys.executable, "-m", "mg_cli.main", *args], cwd=cwd, env=full_env,
                              capture_output=True, text=True, timeout=timeout)
    else:
        with tempfile.TemporaryDirectory(prefix="mg-e2e-") as workdir:
            proc = _ZYGOTE.run(list(args), full_env, cwd, timeout, Path(workdir))
    if check and proc.returncode != 0:
        raise AssertionError(f"mg {' '.join(args)} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
                             f"stderr:\n{proc.stderr[-5000:]}")
    return proc


def mg_start(*args: str, stdout: Path | str, stderr: Path | None = None, cwd: Path | None = None,
             env: dict | None = None) -> ZygoteProcess:
    """Start ``python -m mg_cli.main ARGS`` as ``mg()`` runs it, in a session of its own, and return at once with
    a ``subprocess.Popen``-like handle (see ``zygote.ZygoteProcess``). Its stdout goes to the file ``stdout``
    (``os.devnull`` to drop it), its stderr to ``stderr`` or, when None, to ``stdout`` too."""
    return _ZYGOTE.popen(list(args), _mg_env(env), cwd, Path(stdout), stderr)


def read_metrics(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def train_losses(log_dir: Path) -> dict[int, float]:
    return {r["iteration"]: r["loss"] for r in read_metrics(log_dir) if "loss" in r}


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """Tokenizer + dataset prefix shared by every end-to-end test."""
    root = tmp_path_factory.mktemp("corpus")
    jsonl = stdlib_corpus(root / "corpus.jsonl", 1_500_000)
    # Line by line: the layout-parity tests compare fp32 runs at 1e-5 relative. With the whitespace-exact
    # tokenizer of this corpus, one embedding row's first gradient is a near-total cancellation of larger
    # terms, so tp1 and tp2 round it differently, and Adam's first step (about lr * sign(g)) turns that into
    # a 1e-4 weight difference (7% of lr) and a 4e-5 grad_norm difference at iteration 2. The data decides
    # that, not the layout; the BERT/T5 corpus below and the tokenizer tests cover whitespace-exact training.
    mg("tokenizer", "train", "--input", str(jsonl), "--output-prefix", str(root / "tok"), "--vocab-size", "512",
       "--max-lines", "50000", "--line-by-line")
    mg("preprocess", "--input", str(jsonl), "--tokenizer-model", str(root / "tok.model"), "--output-prefix",
       str(root / "data"), "--append-eod", "--workers", "2", "--partition-mb", "1")
    return {"root": root, "jsonl": jsonl, "tokenizer": root / "tok.model", "prefix": root / "data_text_document"}


TINY = [
    "model.preset=tiny-gpt2", "model.num_layers=4", "model.seq_length=32",
    "train.micro_batch_size=2", "train.global_batch_size=8", "train.seed=7",
    "optim.lr=3e-3", "optim.warmup_iters=2", "optim.decay_style=cosine", "optim.clip_grad=1.0",
    "eval.interval=0", "eval.iters=1", "log.interval=1", "data.num_workers=0", "train.threads=1",
]


def tiny_args(corpus: dict[str, Path], log_dir: Path, *extra: str, iters: int = 20) -> list[str]:
    """``mg train`` arguments for the tiny test model; ``extra`` are more ``--set`` values or flags."""
    args = ["train"]
    for s in TINY + [f"train.iters={iters}", f"data.path={corpus['prefix']}",
                     f"data.tokenizer_model={corpus['tokenizer']}", f"log.dir={log_dir}"]:
        args += ["--set", s]
    for e in extra:
        args += ["--set", e] if "=" in e and not e.startswith("--") else [e]
    return args


@pytest.fixture(scope="session")
def bert_t5_corpus(tmp_path_factory) -> dict[str, Path]:
    """A smaller corpus with a tokenizer holding BERT's and T5's special tokens, preprocessed twice: one
    sequence per sentence (BERT) and one per document (T5)."""
    root = tmp_path_factory.mktemp("bert_t5_corpus")
    jsonl = stdlib_corpus(root / "corpus.jsonl", 600_000)
    mg("tokenizer", "train", "--input", str(jsonl), "--output-prefix", str(root / "tok"), "--vocab-size", "512",
       "--max-lines", "20000", "--user-defined-symbols", "<pad>,<cls>,<sep>,<mask>", "--extra-ids", "16")
    for flag in ("--split-sentences", "--append-eod"):
        mg("preprocess", "--input", str(jsonl), "--tokenizer-model", str(root / "tok.model"), "--output-prefix",
           str(root / "data"), flag, "--workers", "1")
    return {"root": root, "jsonl": jsonl, "tokenizer": root / "tok.model",
            "sentences": root / "data_text_sentence", "documents": root / "data_text_document"}


FAMILY_SETS = {
    "bert": ["model.type=bert", "model.preset=tiny-bert", "model.seq_length=64"],
    "t5": ["model.type=t5", "model.preset=tiny-t5", "model.seq_length=64"],
}


def family_args(corpus: dict[str, Path], family: str, log_dir: Path, *extra: str, iters: int = 10) -> list[str]:
    """``mg train`` arguments for the tiny BERT or T5 test model on ``bert_t5_corpus``."""
    data = corpus["sentences"] if family == "bert" else corpus["documents"]
    sets = [s for s in TINY if not s.startswith("model.")] + FAMILY_SETS[family] + [
        "data.split=80,20,0", f"train.iters={iters}", f"data.path={data}",
        f"data.tokenizer_model={corpus['tokenizer']}", f"log.dir={log_dir}"]
    args = ["train"]
    for s in sets:
        args += ["--set", s]
    for e in extra:
        args += ["--set", e] if "=" in e and not e.startswith("--") else [e]
    return args


def read_checkpoint(path: Path, prefix: str = "") -> dict:
    """Every tensor of an mg checkpoint (a save directory's latest, or an ``iter_*`` directory) whose name
    starts with ``prefix``, unsharded, after verifying every file's checksum."""
    from mg_ckpt import CheckpointReader

    reader = CheckpointReader(str(path), verify=True)
    return reader.read([n for n in reader.specs if n.startswith(prefix)])


def processes_with_marker(marker: str) -> list[int]:
    """Pids of live processes whose environment holds ``MG_RUN_ID=marker``."""
    needle = f"MG_RUN_ID={marker}".encode()
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(pid))
        except OSError:
            continue
    return pids


BASE_SETTINGS = {"tp": 1, "pp": 1, "dp": 1, "vpp": 1, "sequence_parallel": False, "distributed_optimizer": False,
                 "recompute": "none", "precision": "fp32", "micro_batches": 4, "schedule": "no_pipelining"}
"""The effective settings a one-process run of the tiny test models reports."""


def settings_line(settings: dict) -> str:
    """The settings as `mg train`'s start line prints them."""
    return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in settings.items())


def iteration_records(log_dir: Path) -> dict[int, dict]:
    """The metrics.jsonl record of every logged training iteration, by iteration."""
    return {r["iteration"]: r for r in read_metrics(log_dir) if "loss" in r}


def assert_config_error(corpus: dict[str, Path], tmp_path: Path, nproc: int, sets: list[str], message: str) -> None:
    """``mg train`` with ``sets`` on ``nproc`` processes exits 1 with ``message`` in its one-line error (checked
    before any process is launched, so it runs in this process)."""
    from click.testing import CliRunner

    from mg_cli.main import cli

    result = CliRunner().invoke(cli, [*tiny_args(corpus, tmp_path, *sets), "--nproc-per-node", str(nproc)])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[-1].startswith("Error: ") and message in lines[-1], result.output[-3000:]


def assert_reports_settings(log_dir: Path, out: str, nproc: int, settings: dict) -> None:
    """The start line and the first metrics.jsonl record name exactly these effective settings."""
    assert f"mg train: {nproc} processes, {settings_line(settings)}" in out, out[:2000]
    first = read_metrics(log_dir)[0]
    assert first.get("event") == "start", f"the first metrics.jsonl record is not the run's start: {first}"
    assert first["settings"] == settings and first["processes"] == nproc, first


def assert_same_training(records: dict[int, dict], ref: dict[int, dict], what: str, rel: float = 1e-5) -> None:
    """Loss and grad_norm at every iteration of ``ref`` within ``rel``."""
    assert sorted(records) == sorted(ref), what
    for it, r in ref.items():
        assert records[it]["loss"] == pytest.approx(r["loss"], rel=rel), f"{what}: loss at iteration {it}"
        assert records[it]["grad_norm"] == pytest.approx(r["grad_norm"], rel=rel), f"{what}: grad_norm at {it}"


def assert_same_parameters(params: dict, ref: dict, what: str, tol: float = 1e-5) -> None:
    """Unsharded model states agree: the whole state within ``tol`` relative to its norm, and every tensor within
    ``tol`` root mean square. (Adam turns last-bit differences of near-zero gradients, such as a key bias's,
    which is zero in exact arithmetic, into steps of single elements, which an element-wise bound would flag.)"""
    assert params.keys() == ref.keys(), what
    diff2 = sum(((params[n] - v) ** 2).sum() for n, v in ref.items())
    norm2 = sum((v**2).sum() for v in ref.values())
    assert (diff2 / norm2).sqrt().item() <= tol, f"{what}: parameters differ"
    for name, value in ref.items():
        rms = (params[name] - value).pow(2).mean().sqrt().item()
        assert rms <= tol, f"{what}: {name} differs by {rms:.3g} (root mean square)"


class LayoutRuns:
    """The uninterrupted 20-iteration tiny-model run of each layout, run once per session and shared.

    Each saves at iterations 10 and 20 (``checkpoint.interval=10``), so tests can resume from
    iteration 10 and compare with iterations 11..20 of the same run, and compare the final
    parameters with another layout's.
    """

    def __init__(self, corpus: dict[str, Path], root: Path) -> None:
        self.corpus, self.root = corpus, root
        self._runs: dict[tuple, tuple[Path, Path, str]] = {}

    def get(self, nproc: int, sets: tuple[str, ...] = ()) -> tuple[Path, Path, str]:
        """``(log dir, save dir, stdout)`` of the run with ``sets`` on ``nproc`` processes."""
        key = (nproc, tuple(sets))
        if key not in self._runs:
            d = self.root / f"run{len(self._runs)}"
            args = tiny_args(self.corpus, d / "log", f"checkpoint.save={d / 'ckpt'}", "checkpoint.interval=10", *sets)
            if nproc > 1:
                args += ["--nproc-per-node", str(nproc)]
            out = mg(*args).stdout
            self._runs[key] = (d / "log", d / "ckpt", out)
        return self._runs[key]


@pytest.fixture(scope="session")
def layout_runs(corpus, tmp_path_factory) -> LayoutRuns:
    return LayoutRuns(corpus, tmp_path_factory.mktemp("layout_runs"))
