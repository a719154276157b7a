"""`benchmarks/gpu_check.sh --dry-run`: every part of the GPU check runs on the CPU with tiny models and passes, so
the one run on a GPU machine can fail only for what the GPU shows (figures of the dry run measure nothing)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.e2e.conftest import REPO

PARTS = ["unit", "checkpoint", "generate", "multi_gpu", "train"]
COMPILED = "llama-1b"  # the dry run compiles this model only (one CPU compile takes ~20 s)


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--dry-run"], cwd=tmp_path,
                          env={**os.environ, "OUT": str(tmp_path / "out")}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["device"] == "cpu (dry run)" and len(report["commit"]) == 40 and report["torch"], report
    parts = report["parts"]
    assert list(parts) == PARTS and report["failed"] == []
    assert {n: p["status"] for n, p in parts.items()} == dict.fromkeys(PARTS, "passed"), proc.stdout
    assert all(p["seconds"] > 0 and p["limit_s"] > 0 for p in parts.values())
    assert "gpu_check" in proc.stdout and "train" in proc.stdout  # the table

    unit = parts["unit"]["figures"]
    assert unit["passed"] > 0 and unit["failed"] == unit["errors"] == 0, parts["unit"]

    for name, model in parts["train"]["models"].items():
        assert model["parameters"] > 0
        kinds = ["eager", "recompute"] + (["compiled"] if name == COMPILED else [])
        for kind in kinds:
            v = model[kind]
            assert v["status"] == "passed", (name, kind, v)
            assert v["tokens_per_s"] > 0 and v["tflops_per_device"] > 0 and v["mfu"] > 0, (name, kind, v)
            # Against the CPU peak measured at start-up, mfu is the accounting, not a fraction for certain.
            assert v["mfu_peak_source"].startswith("measured "), (name, kind, v)
            assert v["mfu"] == pytest.approx(v["tflops_per_device"] / v["mfu_peak_tflops"], rel=1e-9), (name, kind, v)
        assert [r["micro_batch"] for r in model["eager"]["search"]] in ([1], [1, 2]), model["eager"]
        assert model["recompute"]["granularity"] in ("selective", "full")
        if name == COMPILED:
            assert model["compiled"]["compile_s"] > 0 and model["compiled"]["settings"]["compiled_layers"] > 0
        else:
            assert model["compiled"] == {"status": "skipped", "reason": model["compiled"]["reason"]}
            assert model["compiled"]["reason"].startswith("dry run: only llama-1b is compiled")

    ckpt = parts["checkpoint"]
    assert all(ckpt["checks"].values()), ckpt
    assert ckpt["figures"]["save_vs_raw_write"] > 0 and ckpt["figures"]["load_vs_raw_read"] > 0
    assert set(ckpt["targets"]) == {"save >= 0.7x raw write", "load >= 0.7x raw read"}

    gen = parts["generate"]["figures"]
    assert set(gen) == {"batch1", "batch32"}
    assert all(f["mg_tokens_per_s"] > 0 and f["hf_tokens_per_s"] > 0 for f in gen.values()), gen

    multi = parts["multi_gpu"]["layouts"]
    assert set(multi) == {"1", "tp2", "dp2"}
    for name in ("tp2", "dp2"):
        assert multi[name]["parity"] is True and multi[name]["tokens_per_s"] > 0, multi[name]
        assert max(multi[name]["max_rel_diff"].values()) <= 1e-5
