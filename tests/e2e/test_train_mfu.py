"""Throughput figures of `mg train`, checked as accounting: `tflops_per_device` = FLOPs per token (the formula
below, written for the tiny GPT-2) x tokens / step time, and `mfu` = that / the peak, with a configured peak
(`log.peak_tflops`) and with the peak measured at start-up. A step above its peak keeps its computed `mfu` and
is reported (`mfu_note`, one warning line). Also the start-up line when the precision's matmuls are slower than
fp32 (bf16 on this CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import TINY, mg, read_metrics, tiny_args

SLOWER = "matmuls run"
LAYERS = 2
TINY_PEAK_TFLOPS = 1e-6  # 1 MFLOP/s: every step of the tiny model runs faster


def _native_bf16_cpu() -> bool:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return True
    return any(f in flags.split() for f in ("avx512_bf16", "amx_bf16"))


def _setting(name: str) -> int:
    return int(next(s.split("=", 1)[1] for s in TINY if s.startswith(name + "=")))


def gpt2_flops_per_token(corpus: dict[str, Path]) -> float:
    """Training FLOPs per token of the tiny GPT-2: 2 FLOPs per multiply-add, forward + 2x backward, of the
    q/k/v/o projections (4h^2), the MLP (2hf), q.k^T and attention x v over the whole sequence (2sh) per layer,
    and the output head (hV)."""
    from mg_data import build_tokenizer
    from mg_models import get_config

    c = get_config("tiny-gpt2", vocab_size=512)
    assert c.query_groups == c.num_attention_heads and c.activation.startswith("gelu"), "the formula is GPT-2's"
    h, f, s = c.hidden_size, c.ffn_size, _setting("model.seq_length")
    vocab = build_tokenizer(str(corpus["tokenizer"])).vocab_size
    return 6.0 * (LAYERS * (4 * h * h + 2 * h * f + 2 * s * h) + h * vocab)


def _train(corpus: dict[str, Path], log_dir: Path, *sets: str) -> tuple[dict, list[dict], str]:
    out = mg(*tiny_args(corpus, log_dir, f"model.num_layers={LAYERS}", *sets, iters=3)).stdout
    rows = read_metrics(log_dir)
    train = [r for r in rows if "loss" in r]
    assert rows[0]["event"] == "start" and [r["iteration"] for r in train] == [1, 2, 3]
    return rows[0], train, out


def _assert_accounting(train: list[dict], flops_per_token: float, peak_tflops: float) -> None:
    tokens = _setting("train.global_batch_size") * _setting("model.seq_length")  # one process
    for r in train:
        achieved = flops_per_token * tokens / r["step_time_s"]  # FLOP/s of the one device
        assert r["tokens_per_s"] == pytest.approx(tokens / r["step_time_s"], rel=1e-9), r
        assert r["tflops_per_device"] == pytest.approx(achieved / 1e12, rel=1e-9), r
        assert r["mfu"] == pytest.approx(achieved / (peak_tflops * 1e12), rel=1e-9), r


def test_configured_peak_accounting_and_a_step_above_it(corpus, tmp_path):
    start, train, out = _train(corpus, tmp_path, "train.precision=fp32", f"log.peak_tflops={TINY_PEAK_TFLOPS}")
    assert start["mfu_peak_tflops_per_device"] == TINY_PEAK_TFLOPS
    assert start["mfu_peak_source"] == "configured log.peak_tflops"
    _assert_accounting(train, gpt2_flops_per_token(corpus), TINY_PEAK_TFLOPS)
    for r in train:  # far above the peak: reported as computed, with the note
        assert r["mfu"] > 1, r
        assert r["mfu_note"].startswith(f"step achieved {r['tflops_per_device']:.4g} TFLOP/s above the configured "
                                        f"peak {TINY_PEAK_TFLOPS:.4g} (configured log.peak_tflops): "), r
    warnings = [line for line in out.splitlines() if line.startswith("warning: ")]
    assert warnings == [f"warning: iteration 1: {train[0]['mfu_note']} (each such step has this mfu_note in "
                        f"metrics.jsonl)"], out
    assert [line for line in out.splitlines() if SLOWER in line] == []


def test_measured_peak_accounting(corpus, tmp_path):
    start, train, out = _train(corpus, tmp_path, "train.precision=bf16")
    assert start["mfu_peak_source"] in ("measured bf16 on cpu", "measured fp32 on cpu"), start
    peak = start["mfu_peak_tflops_per_device"]
    _assert_accounting(train, gpt2_flops_per_token(corpus), peak)
    for r in train:  # mfu in (0, 1] means nothing against a measured CPU peak; a step above it must say so
        assert r["mfu"] > 0 and ("mfu_note" in r) == (r["mfu"] > 1), r
        assert "the peak measurement was disturbed" in r.get("mfu_note", "the peak measurement was disturbed"), r
    slower = [line for line in out.splitlines() if SLOWER in line]
    if not _native_bf16_cpu():  # AVX2-only CPUs run bf16 matmuls far slower than fp32
        assert len(slower) == 1, out
        assert slower[0].startswith("train.precision=bf16: bf16 matmuls run ")
        assert slower[0].endswith("x fp32 on this cpu; fp32 would be faster")
