"""What a run leaves behind: metrics.jsonl fields, evaluations, TensorBoard events, an offline Weights & Biases run,
the resolved config, a plot. One run serves every test here."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import assert_config_error, mg, read_metrics, tiny_args

HAS_WANDB = find_spec("wandb") is not None


@pytest.fixture(scope="module")
def logged_run(corpus, tmp_path_factory) -> tuple[Path, str]:
    """(log dir, stdout) of a 4-iteration run evaluating every 2, with TensorBoard and, where wandb is installed,
    an offline W&B run (its files under the log dir, nothing sent anywhere)."""
    log_dir = tmp_path_factory.mktemp("logged_run")
    wandb = ["log.wandb_project=mg-test", "log.wandb_run_name=tiny", "log.wandb_mode=offline"] if HAS_WANDB else []
    env = {"WANDB_DIR": "", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(log_dir / "wandb_config"),
           "WANDB_CACHE_DIR": str(log_dir / "wandb_cache"), "WANDB_DATA_DIR": str(log_dir / "wandb_data")}
    out = mg(*tiny_args(corpus, log_dir, "eval.interval=2", "eval.iters=1", "log.tensorboard=true",
                        "model.num_layers=2", *wandb, iters=4), env=env).stdout
    return log_dir, out


def test_metrics_tensorboard_config_and_plot(logged_run):
    log_dir, out = logged_run
    rows = read_metrics(log_dir)
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "val_loss" in r]
    assert [r["iteration"] for r in train] == [1, 2, 3, 4]
    for r in train:
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_bytes", "skipped"):
            assert key in r, key
        assert r["tokens_per_s"] > 0 and r["peak_mem_bytes"] > 0 and r["skipped"] is False
    assert [r["iteration"] for r in evals] == [2, 4]
    assert all(math.isclose(r["val_ppl"], math.exp(r["val_loss"]), rel_tol=1e-6) for r in evals)
    assert list((log_dir / "tensorboard").glob("events.out.tfevents.*"))
    saved = yaml.safe_load((log_dir / "config.yaml").read_text())
    assert saved["train"]["iters"] == 4 and saved["model"]["num_layers"] == 2
    assert "resolved config:" in out and "iteration 1 | loss" in out
    png = mg("plot", str(log_dir)).stdout.strip()
    assert png.endswith("curves.png")


def wandb_records(path: Path) -> list[dict]:
    """The records of a ``.wandb`` transaction log, read by wandb itself (``wandb leet inspect --json``; wandb
    releases before that command: its Python reader), as ``{"type": ..., <type>: {...}}``."""
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode == 0:
        return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    from google.protobuf.json_format import MessageToDict
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    store, records = datastore.DataStore(), []
    store.open_for_scan(str(path))
    while (data := store.scan_data()) is not None:
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        kind = rec.WhichOneof("record_type")
        body = MessageToDict(getattr(rec, kind), preserving_proto_field_name=True)
        if kind == "history":  # items as key: value, as the command writes them
            body["item"] = {i.get("key") or "/".join(i["nested_key"]): json.loads(i["value_json"])
                            for i in body.get("item", [])}
        records.append({"type": kind, kind: body})
    return records


@pytest.mark.skipif(not HAS_WANDB, reason="needs the mg-cli[wandb] extra")
def test_wandb_offline_run_has_the_metrics_and_config(logged_run):
    log_dir, _ = logged_run
    runs = list((log_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list(log_dir.rglob("*"))
    records = wandb_records(next(runs[0].glob("run-*.wandb")))
    run = next(r["run"] for r in records if r["type"] == "run")
    assert run["project"] == "mg-test" and run["display_name"] == "tiny", run
    history: dict[int, dict] = {}  # step -> the values logged at it
    for r in records:
        if r["type"] == "history":
            step = int(r["history"].get("step", {}).get("num", r["history"]["item"]["_step"]))
            history.setdefault(step, {}).update(r["history"]["item"])
    metrics = read_metrics(log_dir)
    train = {r["iteration"]: r for r in metrics if "loss" in r}
    evals = {r["iteration"]: r for r in metrics if "val_loss" in r}
    assert sorted(history) == sorted(train) == [1, 2, 3, 4]
    for it, r in train.items():  # the same numbers, at step = iteration
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "tflops_per_device", "step_time_s"):
            assert history[it][key] == r[key], (it, key, history[it], r)
        assert "skipped" not in history[it]  # booleans are not scalars, as in TensorBoard
    for it, r in evals.items():
        assert history[it]["val_loss"] == r["val_loss"] and history[it]["val_ppl"] == r["val_ppl"]
    # The resolved config, as config.yaml has it, and the start record's settings and peak.
    config = {}
    for r in records:
        body = r.get("run", {}).get("config") or r.get("config") or {}
        config.update({k: v for k, v in body.get("update", {}).items()})
    saved = yaml.safe_load((log_dir / "config.yaml").read_text())
    for section in ("model", "train", "optim", "data", "log"):
        assert config[section] == saved[section], section
    start = metrics[0]
    assert config["start"]["settings"] == start["settings"]
    assert config["start"]["mfu_peak_source"] == start["mfu_peak_source"]
    exits = [r["exit"] for r in records if r["type"] == "exit"]
    assert len(exits) == 1 and exits[0].get("exit_code", 0) == 0, exits  # finished, not left open


def test_missing_wandb_is_one_line_before_launch(corpus, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: find_spec and import see nothing
    assert_config_error(corpus, tmp_path, 2, ["log.wandb_project=p"],
                        "log.wandb_project is set but wandb is not installed; pip install 'mg-cli[wandb]'")


@pytest.mark.skipif(not HAS_WANDB, reason="needs the mg-cli[wandb] extra")
def test_a_failing_wandb_init_is_one_line(tmp_path):
    from mg_cli.training.metrics import MetricsLogger
    from mg_cli.training.setup import TrainingError

    with pytest.raises(TrainingError, match=r"^log.wandb_project: wandb.init failed: .*log.wandb_mode=offline") as e:
        MetricsLogger(tmp_path, enabled=True, total_iters=1, start_iter=0,
                      wandb={"project": "p", "mode": "no-such-mode", "dir": str(tmp_path)})
    assert "\n" not in str(e.value)
