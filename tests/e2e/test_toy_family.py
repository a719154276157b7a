"""A model family from outside mg (tests/e2e/fixtures/mg_toy_family: a package whose only tie to mg is its
``mg_models.families`` entry point) trains at tp2 and generates through the unchanged ``mg`` command."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from mg_ckpt import CheckpointReader
from tests.e2e.conftest import REPO, mg, read_checkpoint, tiny_args, train_losses

FIXTURE = REPO / "tests" / "e2e" / "fixtures" / "mg_toy_family"


def test_an_installed_family_trains_at_tp2_and_generates(corpus, tmp_path):
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(site), str(FIXTURE)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    # A fresh interpreter: the families are found once per process, from what is installed when it starts.
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    args = tiny_args(corpus, tmp_path / "log", f"checkpoint.save={tmp_path / 'ckpt'}", "optim.warmup_iters=0",
                     iters=1)
    out = mg(*args, "--set", "model.type=toy", "--set", "model.preset=toy-tiny", "--set", "parallel.tp=2",
             "--nproc-per-node", "2", env=env, fresh=True).stdout
    assert "mg train: 2 processes, tp=2 " in out, out[-2000:]
    assert list(train_losses(tmp_path / "log")) == [1]

    state = CheckpointReader(str(tmp_path / "ckpt")).extra
    assert state["model_family"] == "toy" and state["model_config"]["embedding_scale"] == 4.0
    params = read_checkpoint(tmp_path / "ckpt", "model/")
    assert params["model/embedding.word_embeddings.weight"].shape[1] == 32  # the toy preset's width, unsharded

    gen = mg("generate", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "def main(", "--max-new-tokens", "4",
             "--json", env=env, fresh=True)
    (row,) = json.loads(gen.stdout)
    assert len(row["generated_ids"]) >= 1 and row["prompt"] == "def main("

    unknown = mg(*args, "--set", "model.type=toy", "--set", "model.preset=toy-tiny", check=False)  # not installed
    assert unknown.returncode == 1, unknown.stdout
    assert unknown.stderr.strip().splitlines()[-1] == (
        "Error: --set: model.type='toy' is not an installed model family; choose one of ['gpt', 'bert', 't5']")
