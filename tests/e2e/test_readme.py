"""The README's quick path, run as a reader pastes it.

The fenced block after ``<!-- quick-path -->`` in the top-level README is read from the README itself (so the
two cannot drift) and each of its lines runs with bash in an empty directory that holds only a link to the
repository's ``examples/``, with this environment's ``python`` and ``mg`` first on PATH. The run is shared by
the tests below, each checking what one step promised: the checkpoint and logs the config names, generated
text, a perplexity, a Hugging Face export, the inspection of the checkpoint and a PNG of the curves. The train
step runs ``examples/tiny_gpt.yaml`` with its defaults, among them ``data.num_workers`` (a loader worker).
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import REPO, read_metrics

pytestmark = pytest.mark.smoke

MARKER = "<!-- quick-path -->"


def quick_path(readme: Path = REPO / "README.md") -> list[str]:
    """The command lines of the fenced block right after ``MARKER`` in ``readme`` (continuations joined,
    blank and comment-only lines left out)."""
    text = readme.read_text()
    assert text.count(MARKER) == 1, f"{readme} must hold {MARKER} exactly once"
    after = text.split(MARKER, 1)[1].lstrip("\n")
    assert after.startswith("```"), f"{MARKER} must be followed by a fenced block"
    block = after.split("\n", 1)[1].split("\n```", 1)[0].replace("\\\n", " ")
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _argv(line: str) -> list[str]:
    return shlex.split(line, comments=True)


def _option(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {shlex.join(argv)}"
    return argv[argv.index(name) + 1]


def quick_path_configs() -> list[str]:
    """The ``examples/*.yaml`` files the quick path trains."""
    return [Path(_option(a, "--config")).name for a in map(_argv, quick_path()) if a[:2] == ["mg", "train"]]


class QuickPath:
    """The quick path's lines, run once in ``work``; ``steps[command]`` is ``(argv, stdout)`` of the line
    whose first words are ``command`` (e.g. ``"mg generate"``)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        (work / "examples").symlink_to(REPO / "examples")
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        self.steps: dict[str, tuple[list[str], str]] = {}
        for line in quick_path():
            proc = subprocess.run(["bash", "-c", line], cwd=work, env=env, capture_output=True, text=True,
                                  timeout=600)
            assert proc.returncode == 0, (f"{line!r} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
                                          f"stderr:\n{proc.stderr[-5000:]}")
            argv = _argv(line)
            key = " ".join(argv[:3] if argv[:2] == ["mg", "tokenizer"] else argv[:2])
            assert key not in self.steps, f"two quick-path lines start with {key!r}; the tests tell them apart by it"
            self.steps[key] = (argv, proc.stdout)

    def step(self, key: str) -> tuple[list[str], str]:
        assert key in self.steps, f"the quick path has no {key!r} line: {sorted(self.steps)}"
        return self.steps[key]

    def train_config(self) -> dict:
        argv, _ = self.step("mg train")
        assert "--set" not in argv, "the checks below read the paths from the config file alone"
        return yaml.safe_load((self.work / _option(argv, "--config")).read_text())


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> QuickPath:
    return QuickPath(tmp_path_factory.mktemp("readme"))


def test_corpus_tokenizer_and_dataset(run):
    argv, _ = run.step("python examples/make_corpus.py")
    corpus = argv[2]
    docs = [json.loads(line) for line in (run.work / corpus).read_text().splitlines()]
    assert docs and all(isinstance(d["text"], str) and d["text"] for d in docs)
    assert (run.work / corpus).stat().st_size < 2_000_000, "the quick path's corpus should stay small"
    argv, _ = run.step("mg tokenizer train")
    assert _option(argv, "--input") == corpus
    assert (run.work / (_option(argv, "--output-prefix") + ".model")).is_file()
    argv, _ = run.step("mg preprocess")
    assert _option(argv, "--input") == corpus
    prefix = run.work / (_option(argv, "--output-prefix") + "_text_document")
    for suffix in (".bin", ".idx"):
        assert Path(f"{prefix}{suffix}").stat().st_size > 0


def test_train_reads_the_data_and_saves_a_checkpoint(run):
    config = run.train_config()
    assert config["data"]["path"] == _option(run.step("mg preprocess")[0], "--output-prefix") + "_text_document"
    assert config["data"]["tokenizer_model"] == _option(run.step("mg tokenizer train")[0], "--output-prefix") + ".model"
    save, log, iters = config["checkpoint"]["save"], config["log"]["dir"], config["train"]["iters"]
    assert (run.work / save / "latest").is_file()
    assert (run.work / save / f"iter_{iters:07d}").is_dir()
    records = read_metrics(run.work / log)
    losses = {r["iteration"]: r["loss"] for r in records if "loss" in r}
    assert sorted(losses) == list(range(1, iters + 1)) and all(math.isfinite(v) for v in losses.values())
    assert any("val_loss" in r for r in records)


def test_train_runs_the_default_data_loader(run):
    """The config leaves data.num_workers unset, so the run used the default: loader worker processes."""
    from mg_cli.sections import DataKeys

    config = run.train_config()
    assert "num_workers" not in config["data"]
    resolved = yaml.safe_load((run.work / config["log"]["dir"] / "config.yaml").read_text())
    assert resolved["data"]["num_workers"] == DataKeys.num_workers > 0


def test_later_steps_use_what_train_wrote(run):
    config = run.train_config()
    save, log = config["checkpoint"]["save"], config["log"]["dir"]
    assert _option(run.step("mg generate")[0], "--checkpoint") == save
    assert _option(run.step("mg eval")[0], "--checkpoint") == save
    assert _option(run.step("mg convert")[0], "--input") == save
    assert run.step("mg inspect")[0][2] == save
    assert run.step("mg plot")[0][2] == log


def test_generate_continues_the_prompt(run):
    argv, out = run.step("mg generate")
    prompt = _option(argv, "--prompt")
    assert out.startswith(prompt), out
    assert out[len(prompt):].strip(), f"nothing generated after the prompt: {out!r}"


def test_eval_prints_a_perplexity(run):
    argv, out = run.step("mg eval")
    assert _option(argv, "--task").startswith("perplexity:")
    match = re.search(r"^\s*(?:\S+\s+)?perplexity\s+([0-9.]+)\s", out, re.M)
    assert match, out
    assert 1.0 < float(match.group(1)) < float("inf")


def test_hf_export_has_a_config(run):
    argv, out = run.step("mg convert")
    assert _option(argv, "--to") == "hf"
    export = run.work / _option(argv, "--output")
    config = json.loads((export / "config.json").read_text())
    import sentencepiece as spm

    tok = run.work / run.train_config()["data"]["tokenizer_model"]
    assert config["vocab_size"] == spm.SentencePieceProcessor(model_file=str(tok)).get_piece_size(), config
    assert list(export.glob("*.safetensors")), out


def test_inspect_describes_the_saved_checkpoint(run):
    argv, out = run.step("mg inspect")
    iters = run.train_config()["train"]["iters"]
    assert f"checkpoint {argv[2]}/iter_{iters:07d}" in out and "checksums verified" in out, out[:2000]


def test_plot_writes_a_png(run):
    argv, out = run.step("mg plot")
    png = run.work / argv[2] / "curves.png"
    assert out.strip() == str(Path(argv[2]) / "curves.png"), out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
