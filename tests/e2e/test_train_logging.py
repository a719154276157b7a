"""What a run leaves behind: metrics.jsonl fields, evaluations, TensorBoard events, the resolved config, a plot."""

from __future__ import annotations

import math

import yaml

from tests.e2e.conftest import mg, read_metrics, tiny_args


def test_metrics_tensorboard_config_and_plot(corpus, tmp_path):
    out = mg(*tiny_args(corpus, tmp_path, "eval.interval=2", "eval.iters=1", "log.tensorboard=true",
                        "model.num_layers=2", iters=4)).stdout
    rows = read_metrics(tmp_path)
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "val_loss" in r]
    assert [r["iteration"] for r in train] == [1, 2, 3, 4]
    for r in train:
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_bytes", "skipped"):
            assert key in r, key
        assert r["tokens_per_s"] > 0 and r["peak_mem_bytes"] > 0 and r["skipped"] is False
    assert [r["iteration"] for r in evals] == [2, 4]
    assert all(math.isclose(r["val_ppl"], math.exp(r["val_loss"]), rel_tol=1e-6) for r in evals)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["train"]["iters"] == 4 and saved["model"]["num_layers"] == 2
    assert "resolved config:" in out and "iteration 1 | loss" in out
    png = mg("plot", str(tmp_path)).stdout.strip()
    assert png.endswith("curves.png")
