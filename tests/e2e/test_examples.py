"""Every ``examples/*.yaml`` trains.

Each config runs two iterations as ``mg train --config examples/NAME.yaml`` with ``--set`` overriding only the
data (the shared tiny corpus), the iterations, warm-up, logging interval and evaluation batches, in an empty
directory where its checkpoint and log paths land. A config larger than the tiny presets also gets the reduced
shape named in ``REDUCED``, so CI stays cheap. The configs the README's quick path trains are run there, as
written (tests/e2e/test_readme.py), and left out here.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import REPO, mg, read_metrics
from tests.e2e.test_readme import quick_path_configs

EXAMPLES = sorted(p.name for p in (REPO / "examples").glob("*.yaml"))

CHEAP = ["train.iters=2", "optim.warmup_iters=1", "eval.iters=1", "log.interval=1"]
"""Two iterations, each logged, one warm-up step (a schedule needs warmup <= iters), one validation batch."""

REDUCED = {
    "gpt_125m.yaml": ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
                      "model.ffn_hidden_size=128", "model.seq_length=64", "train.micro_batch_size=2",
                      "train.global_batch_size=4"],
}
"""A smaller shape and batch for the examples sized for GPUs (the rest of their config unchanged)."""

TRAINED_HERE = [name for name in EXAMPLES if name not in quick_path_configs()]


def test_every_example_is_trained_by_a_test():
    assert set(quick_path_configs()) <= set(EXAMPLES), "the quick path trains a config that is not in examples/"
    assert set(REDUCED) <= set(TRAINED_HERE)
    for name in TRAINED_HERE:
        model = yaml.safe_load((REPO / "examples" / name).read_text())["model"]
        assert name in REDUCED or str(model.get("preset", "")).startswith("tiny-"), \
            f"{name} is not a tiny preset: give it a reduced shape in REDUCED"


@pytest.mark.parametrize("name", TRAINED_HERE)
def test_example_trains_two_iterations(name, bert_t5_corpus, tmp_path):
    config = yaml.safe_load((REPO / "examples" / name).read_text())
    family = config["model"]["type"]
    data = bert_t5_corpus["sentences"] if family == "bert" else bert_t5_corpus["documents"]
    sets = [f"data.path={data}", f"data.tokenizer_model={bert_t5_corpus['tokenizer']}", *CHEAP, *REDUCED.get(name, [])]
    args = ["train", "--config", str(REPO / "examples" / name)]
    for s in sets:
        args += ["--set", s]
    mg(*args, cwd=tmp_path)

    records = read_metrics(tmp_path / config["log"]["dir"])
    assert records[0]["settings"]["precision"] == config["train"]["precision"]
    losses = {r["iteration"]: r["loss"] for r in records if "loss" in r}
    assert sorted(losses) == [1, 2] and all(math.isfinite(v) for v in losses.values()), losses
    assert any("val_loss" in r for r in records), "no validation at the end of the run"
    save = config["checkpoint"]["save"]
    if save is not None:
        assert (Path(tmp_path) / save / "iter_0000002").is_dir()
