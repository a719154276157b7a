"""A classification run reads its data once per process: the checks before the run build the datasets (the head's
size is the data's label count) and the run uses what they built."""

from __future__ import annotations

import json

from mg_cli.config import load_config
from mg_cli.job import Env
from mg_cli.training import data as data_module
from mg_cli.training.data import RunData
from mg_cli.training.loop import preflight
from mg_data import train_sentencepiece
from mg_parallel.grid import ProcessGrid


def test_preflight_builds_the_classification_data_the_run_uses(tmp_path, monkeypatch):
    rows = [{"text": f"sample number {i} says {'yes' if i % 3 else 'no'}", "label": ["neg", "pos", "mid"][i % 3]}
            for i in range(60)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = train_sentencepiece([path], tmp_path / "tok", vocab_size=320,
                              user_defined_symbols=["<pad>", "<cls>", "<sep>", "<mask>"])
    config = load_config(None, [
        "model.type=bert", "model.preset=tiny-bert", "model.seq_length=16", "data.format=classification",
        f"data.path={path}", f"data.tokenizer_model={tok}", "train.iters=2", "train.global_batch_size=4",
        "train.micro_batch_size=4", "data.split=80,20,0"])
    builds = []
    original = data_module._BUILDERS.copy()
    for cls, build in original.items():
        monkeypatch.setitem(data_module._BUILDERS, cls, lambda *a, _b=build, **k: builds.append(1) or _b(*a, **k))
    plan = preflight(config, Env(rank=0, world_size=1, local_rank=0, local_world_size=1))
    assert plan.labels == (["mid", "neg", "pos"], 3) and plan.model_config.num_labels == 3
    assert len(builds) == 1
    data = RunData(config, ProcessGrid.single(), plan.tokenizer, plan.datasets)
    assert len(builds) == 1, "the run built the datasets again"
    assert data.train_ds is plan.datasets[1][0] and len(data.train_ds) == 48
    assert int(data.train_ds[0]["label"]) in (0, 1, 2)
