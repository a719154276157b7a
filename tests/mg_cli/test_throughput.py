"""The MFU denominator: published peaks by device name, measured peaks otherwise, and the fp32 comparison."""

from __future__ import annotations

import time

import pytest
import torch

from mg_cli.training import throughput
from mg_cli.training.throughput import PeakFlops

CUDA = torch.device("cuda")  # never touched: the name lookup and the measurement are replaced
CPU = torch.device("cpu")


@pytest.mark.parametrize("name, part", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", None),
    ("NVIDIA H200", "H200 SXM"),
    ("NVIDIA H200 NVL", None),
    ("NVIDIA GH200 480GB", None),
    ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A100-PCIE-40GB", "A100"),
    ("NVIDIA A100 80GB PCIe", "A100"),
    ("NVIDIA A100-SXM4-40GB MIG 3g.20gb", None),
    ("NVIDIA A10", None),
    ("NVIDIA RTX A1000", None),
    ("NVIDIA L40S", "L40S"),
    ("NVIDIA L40", None),
    ("NVIDIA B200", "B200"),
    ("NVIDIA GB200", None),
    ("NVIDIA GeForce RTX 4090", None),
    ("cpu", None),
])
def test_published_part_from_device_name(name, part):
    assert throughput.published_part(name) == part


def _no_measurement(*args, **kwargs):
    raise AssertionError("a published peak must not be measured")


@pytest.mark.parametrize("name, dtype, tflops, source", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989, "published H100 SXM bf16"),
    ("NVIDIA H100 80GB HBM3", torch.float16, 989, "published H100 SXM fp16"),
    ("NVIDIA H100 PCIe", torch.bfloat16, 756, "published H100 PCIe bf16"),
    ("NVIDIA H200", torch.bfloat16, 989, "published H200 SXM bf16"),
    ("NVIDIA A100-SXM4-40GB", torch.bfloat16, 312, "published A100 bf16"),
    ("NVIDIA L40S", torch.float16, 362, "published L40S fp16"),
    ("NVIDIA B200", torch.bfloat16, 2250, "published B200 bf16"),
])
def test_known_gpu_uses_published_dense_peak(monkeypatch, name, dtype, tflops, source):
    monkeypatch.setattr(throughput, "device_name", lambda device: name)
    monkeypatch.setattr(throughput, "measure_layout_rates", _no_measurement)
    assert throughput.peak_flops(dtype, CUDA) == PeakFlops(tflops * 1e12, source)


def test_fp8_figures_where_the_part_has_fp8():
    assert throughput.published_peak("NVIDIA H100 80GB HBM3", torch.float8_e4m3fn).flops_per_s == 1979e12
    assert throughput.published_peak("NVIDIA L40S", torch.float8_e4m3fn).flops_per_s == 733e12
    assert throughput.published_peak("NVIDIA B200", torch.float8_e5m2).flops_per_s == 4500e12
    assert throughput.published_peak("NVIDIA A100-SXM4-80GB", torch.float8_e4m3fn) is None


def _fake_rates(table: dict[torch.dtype, float]):
    def rates(dtype, device, **kwargs):
        r = table[dtype]
        return {"nt": r, "nn": r / 2, "tn": r / 4}
    return rates


@pytest.mark.parametrize("name, dtype, source", [
    ("NVIDIA GeForce RTX 4090", torch.bfloat16, "measured bf16 on NVIDIA GeForce RTX 4090"),  # unknown part
    ("NVIDIA H100 NVL", torch.bfloat16, "measured bf16 on NVIDIA H100 NVL"),  # known family, numbers not in table
    ("NVIDIA H100 80GB HBM3", torch.float32, "measured fp32 on NVIDIA H100 80GB HBM3"),  # fp32 on a GPU
])
def test_other_gpus_and_fp32_fall_back_to_measurement(monkeypatch, name, dtype, source):
    monkeypatch.setattr(throughput, "device_name", lambda device: name)
    monkeypatch.setattr(throughput, "measure_layout_rates", _fake_rates({torch.bfloat16: 400e12, torch.float32: 50e12}))
    peak = throughput.peak_flops(dtype, CUDA)
    assert peak.source == source
    assert peak.flops_per_s == (400e12 if dtype == torch.bfloat16 else 50e12)


def test_reduced_precision_peak_is_the_faster_of_it_and_fp32(monkeypatch):
    # A bf16 step may run some matmuls in fp32 (CPU math attention with a learned bias): where fp32 is
    # faster, fp32 is the peak.
    monkeypatch.setattr(throughput, "measure_layout_rates", _fake_rates({torch.bfloat16: 2e9, torch.float32: 80e9}))
    assert throughput.peak_flops(torch.bfloat16, CPU) == PeakFlops(80e9, "measured fp32 on cpu")
    monkeypatch.setattr(throughput, "measure_layout_rates", _fake_rates({torch.bfloat16: 160e9, torch.float32: 80e9}))
    assert throughput.peak_flops(torch.bfloat16, CPU) == PeakFlops(160e9, "measured bf16 on cpu")


def test_speed_vs_fp32_and_the_start_up_line(monkeypatch):
    rates = {torch.bfloat16: {"nt": 8e9, "nn": 2e9, "tn": 24e9}, torch.float32: {"nt": 80e9, "nn": 80e9, "tn": 80e9},
             torch.float16: {"nt": 160e9, "nn": 160e9, "tn": 160e9}}
    monkeypatch.setattr(throughput, "measure_layout_rates", lambda dtype, device, **kw: rates[dtype])
    step_rate = 3 / (1 / 8e9 + 1 / 2e9 + 1 / 24e9)  # equal FLOPs in each layout
    assert throughput.matmul_speed_vs_fp32(torch.bfloat16, CPU) == pytest.approx(step_rate / 80e9)
    assert throughput.matmul_speed_vs_fp32(torch.float32, CPU) == 1.0
    from mg_parallel.precision import Precision

    assert throughput.slower_than_fp32_note(Precision.from_name("bf16"), CPU) == (
        "train.precision=bf16: bf16 matmuls run 0.056x fp32 on this cpu; fp32 would be faster")
    assert throughput.slower_than_fp32_note(Precision.from_name("fp32"), CPU) is None
    assert throughput.slower_than_fp32_note(Precision.from_name("fp16"), CPU) is None  # faster: nothing to say


def test_utilization_is_never_capped():
    measured = PeakFlops(100.0, "measured fp32 on cpu")
    assert measured.utilization(50.0) == 0.5
    assert measured.utilization(150.0) == 1.5 and measured.flops_per_s == 100.0  # a bug to see, not to hide
    assert PeakFlops(100.0, "published H100 SXM bf16").utilization(150.0) == 1.5


def test_configured_peak_wins_over_table_and_measurement(monkeypatch):
    monkeypatch.setattr(throughput, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(throughput, "measure_layout_rates", _no_measurement)
    assert throughput.peak_flops(torch.bfloat16, CUDA, configured_tflops=400.0) == PeakFlops(
        400e12, "configured log.peak_tflops")
    assert throughput.peak_flops(torch.float32, CPU, configured_tflops=0.25).flops_per_s == 0.25e12
    with pytest.raises(ValueError, match="log.peak_tflops=0"):
        throughput.peak_flops(torch.float32, CPU, configured_tflops=0)


@pytest.mark.parametrize("source, says", [
    ("measured fp32 on cpu", "the peak measurement was disturbed"),
    ("published H100 SXM bf16", "FLOPs are over-counted or the figure is wrong"),
    ("configured log.peak_tflops", "log.peak_tflops is below what this device runs"),
])
def test_a_step_above_the_peak_is_a_note_not_a_new_peak(source, says):
    peak = PeakFlops(2e12, source)
    assert peak.excess_note(2e12) is None and peak.excess_note(1e12) is None
    note = peak.excess_note(3e12)
    assert note.startswith(f"step achieved 3 TFLOP/s above the {source.split()[0]} peak 2 ({source}): "), note
    assert says in note and "\n" not in note
    assert peak.flops_per_s == 2e12 and peak.utilization(3e12) == 1.5  # neither raised nor capped


def test_measured_peak_is_the_best_of_repetitions(monkeypatch):
    """Each layout's best size is timed again after the sweep: a sweep slowed by other load (here every first call
    of a size takes 4x) does not become the peak."""
    calls = []

    def fake_call(n, dtype, device, layout, window_s):
        slowdown = 1.0 if (layout, n) in calls else 4.0
        calls.append((layout, n))
        flops_per_s = min(n, 512) ** 3 * 1e6  # rises up to n = 512, then flat
        return 2 * n**3 / flops_per_s * slowdown

    monkeypatch.setattr(throughput, "_fastest_call", fake_call)
    once = throughput.measure_layout_rates(torch.float32, CPU, cache=False, repeats=1)
    sweep = list(calls)
    calls.clear()
    best = throughput.measure_layout_rates(torch.float32, CPU, cache=False, repeats=3)
    slow, fast = 512**3 * 1e6 / 4, 512**3 * 1e6
    assert once == dict.fromkeys(("nt", "nn", "tn"), pytest.approx(slow)), once
    assert best == dict.fromkeys(("nt", "nn", "tn"), pytest.approx(fast)), best
    assert calls[:len(sweep)] == sweep and calls[len(sweep):] == [(lay, 512) for lay in ("nt", "nn", "tn")] * 2
    with pytest.raises(ValueError, match="repeats=0"):
        throughput.measure_layout_rates(torch.float32, CPU, cache=False, repeats=0)


def test_step_record_accounting():
    """tflops_per_device = FLOPs/token x tokens/s / processes and mfu = that / peak, against the formula written
    here; a step above the peak keeps its mfu and gets an mfu_note."""
    from types import SimpleNamespace

    from mg_cli.training.metrics import step_record
    from mg_parallel.precision import Precision

    def record(peak_flops_per_s: float, seconds: float = 0.25) -> dict:
        run = SimpleNamespace(
            config=SimpleNamespace(train=SimpleNamespace(global_batch_size=8), model=SimpleNamespace(seq_length=32)),
            flops_per_token=3.0e6, grid=SimpleNamespace(world_size=2, device=CPU),
            optimizer=SimpleNamespace(loss_scale=1.0), precision=Precision.from_name("fp32"))
        result = SimpleNamespace(iteration=5, loss=2.0, parts={}, lr=1e-3, grad_norm=0.5, seconds=seconds,
                                 applied=True, compile_seconds=0.0)
        return step_record(run, result, PeakFlops(peak_flops_per_s, "configured log.peak_tflops"))

    achieved = 3.0e6 * (8 * 32 / 0.25) / 2  # FLOPs/token x tokens/s / processes: 1.536e9 FLOP/s per device
    r = record(4e9)
    assert r["tokens_per_s"] == pytest.approx(8 * 32 / 0.25) and r["step_time_s"] == 0.25
    assert r["tflops_per_device"] == pytest.approx(achieved / 1e12, rel=1e-12)
    assert r["mfu"] == pytest.approx(achieved / 4e9, rel=1e-12) and "mfu_note" not in r
    low = record(1e9)
    assert low["mfu"] == pytest.approx(achieved / 1e9, rel=1e-12) and low["mfu"] > 1  # not capped
    assert low["mfu_note"].startswith("step achieved 0.001536 TFLOP/s above the configured peak 0.001 ")


def _mlp_step_flops_per_s(dtype: torch.dtype, tokens: int = 256, hidden: int = 256, layers: int = 4) -> float:
    """Best model FLOP/s (6 x weights x tokens) of forward + backward through bias-free linear layers."""
    torch.manual_seed(0)
    weights = [torch.randn(hidden, hidden, dtype=dtype, requires_grad=True) for _ in range(layers)]
    x = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
    flops = 6 * tokens * hidden * hidden * layers
    best = 0.0
    for _ in range(4):
        t0 = time.perf_counter()
        y = x
        for w in weights:
            y = torch.nn.functional.linear(y, w)
        y.float().square().mean().backward()
        best = max(best, flops / (time.perf_counter() - t0))
    return best


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measured_peak_bounds_a_matmul_heavy_step(dtype):
    throughput._measured_once.cache_clear()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a one-thread rate is not at the mercy of other processes holding the cores
    try:
        t0 = time.perf_counter()
        peak = throughput.peak_flops(dtype, CPU)
        measure_s = time.perf_counter() - t0
        achieved = _mlp_step_flops_per_s(dtype)
        own = throughput.measure_matmul_peak(dtype, CPU)  # the dtype's own best layout, without fp32's
    finally:
        torch.set_num_threads(threads)
    assert peak.source.startswith("measured ") and peak.source.endswith(" on cpu")
    assert achieved <= own <= peak.flops_per_s, (achieved, own, peak)
    assert measure_s < 3.0, measure_s  # start-up cost: ~0.2-0.5 s per dtype here
