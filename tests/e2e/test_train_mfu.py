"""Throughput figures of `mg train`: mfu in (0, 1] and tflops_per_device > 0 for every logged iteration, in
fp32 and bf16, and the start-up line when the precision's matmuls are slower than fp32 (bf16 on this CPU)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import mg, read_metrics, tiny_args

SLOWER = "matmuls run"


def _native_bf16_cpu() -> bool:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return True
    return any(f in flags.split() for f in ("avx512_bf16", "amx_bf16"))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_mfu_is_a_fraction_and_tflops_are_logged(corpus, tmp_path, precision):
    out = mg(*tiny_args(corpus, tmp_path, "model.num_layers=2", f"train.precision={precision}", iters=3)).stdout
    train = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [r["iteration"] for r in train] == [1, 2, 3]
    for r in train:
        assert 0 < r["mfu"] <= 1, r
        assert r["tflops_per_device"] > 0, r
    slower = [line for line in out.splitlines() if SLOWER in line]
    if precision == "fp32":
        assert slower == [], slower
    elif not _native_bf16_cpu():  # AVX2-only CPUs run bf16 matmuls far slower than fp32
        assert len(slower) == 1, out
        assert slower[0].startswith("train.precision=bf16: bf16 matmuls run ")
        assert slower[0].endswith("x fp32 on this cpu; fp32 would be faster")
