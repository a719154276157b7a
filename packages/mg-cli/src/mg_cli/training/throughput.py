"""Peak matmul throughput per device: the denominator of ``mfu`` in ``mg train``'s metrics.

Three sources, in this order: a peak given in the configuration (``log.peak_tflops``, for a part not in
the table or to fix the denominator); a known GPU part's published dense (no 2:4 sparsity) peak for the
compute dtype; anything else (CPUs, parts not in the table, fp32 on any GPU) a peak measured at start-up,
before the first step: the best FLOP/s achieved by matmuls in the layouts a training step uses (``x @ W^T``
forward, ``g @ W`` and ``g^T @ x`` backward), over growing square sizes, each size timed as the fastest of
several calls, and each layout's best size timed again in further rounds (best of several repetitions).

A bf16/fp16 step does not run every matmul in its compute dtype: on a CPU, PyTorch's math
attention, taken when the attention bias needs a gradient (T5's learned relative-position bias),
runs its matmuls in fp32. So the measured peak of a reduced precision is the better of that
dtype's and fp32's: the step's average FLOP/s cannot exceed the rate of the fastest dtype it runs
matmuls in. (The published bf16/fp16 peaks of the parts below exceed their fp32/TF32 peaks, so the
same holds for them.)

The peak is fixed for the run: it is never raised to a step's rate and ``mfu`` is never capped. A step
that achieves more than the peak is a measurement problem (a disturbed start-up measurement, a wrong
figure or over-counted FLOPs), which :meth:`PeakFlops.excess_note` describes in one line for the log.
"""

from __future__ import annotations

import functools
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from mg_parallel.precision import Precision

__all__ = [
    "PUBLISHED_TFLOPS", "CompileClock", "PeakFlops", "device_name", "matmul_speed_vs_fp32", "measure_layout_rates",
    "measure_matmul_peak", "peak_flops", "published_part", "published_peak", "slower_than_fp32_note",
]

# Dense tensor-core TFLOP/s per GPU. Sources: NVIDIA's A100, H100, H200 and L40S datasheets and its HGX B200
# specifications. Where a datasheet prints only the figure "with sparsity" (H100, H200, B200), the dense one is
# half of it. fp16 equals bf16 on every part.
PUBLISHED_TFLOPS: dict[str, dict[str, float]] = {
    "H100 SXM": {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp8": 1513.0},
    "H200 SXM": {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0},
    "A100": {"bf16": 312.0, "fp16": 312.0},  # SXM4 and PCIe, 40 and 80 GB: the same tensor-core peak
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp8": 733.0},
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0},  # HGX B200 (1000 W); GB200 differs
}
"""Published dense peak TFLOP/s per device, by part and precision."""

# (part, pattern the upper-cased device name must match, pattern it must not match). Word boundaries keep
# "GB200" from reading as "B200", "A1000" as "A100" and "L40" as "L40S". Parts whose numbers are not in the
# table (H100 NVL, H200 NVL, GH200, GB200, A800, ...) match nothing and are measured instead.
_PARTS: tuple[tuple[str, str, str | None], ...] = (
    ("H100 PCIe", r"\bH100\b.*\bPCIE\b", None),
    ("H100 SXM", r"\bH100\b", r"\b(PCIE|NVL)\b"),  # the SXM5 part reports itself as "NVIDIA H100 80GB HBM3"
    ("H200 SXM", r"\bH200\b", r"\bNVL\b"),
    ("A100", r"\bA100\b", None),
    ("L40S", r"\bL40S\b", None),
    ("B200", r"\bB200\b", None),
)

_PRECISION_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                    torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "fp8"}

SLOWER_THAN_FP32 = 0.9
"""A precision whose matmuls run below this fraction of fp32's is reported as slower (nearer 1 may be timing noise)."""


@dataclass
class PeakFlops:
    """The MFU denominator of one device, fixed for the run."""

    flops_per_s: float
    """Peak FLOP/s of one device (one process's device and threads)."""
    source: str
    """Where it comes from: ``"configured log.peak_tflops"``, ``"published <part> <dtype>"`` or
    ``"measured <dtype> on <device>"``."""

    @property
    def kind(self) -> str:
        """``"configured"``, ``"published"`` or ``"measured"``: the first word of :attr:`source`."""
        return self.source.split(" ", 1)[0]

    def utilization(self, achieved_flops_per_s: float) -> float:
        """``achieved / peak``: the MFU of a step that ran ``achieved_flops_per_s`` model FLOP/s on one device.

        Not capped: above 1 is a measurement problem to report (:meth:`excess_note`), not a value to clip.
        """
        return achieved_flops_per_s / self.flops_per_s

    def excess_note(self, achieved_flops_per_s: float) -> str | None:
        """One line saying what a step that achieved more than the peak means for this peak's source; None
        when ``achieved_flops_per_s`` is within the peak.

        E.g. ``"step achieved 0.0123 TFLOP/s above the measured peak 0.0101 (measured fp32 on cpu): the
        peak measurement was disturbed (...)"``.
        """
        if achieved_flops_per_s <= self.flops_per_s:
            return None
        head = f"step achieved {achieved_flops_per_s / 1e12:.4g} TFLOP/s above the {self.kind} peak " \
               f"{self.flops_per_s / 1e12:.4g} ({self.source}): "
        if self.kind == "measured":
            return head + ("the peak measurement was disturbed (the machine was busier at start-up than now) or "
                           "FLOPs are over-counted; mfu is reported as computed; log.peak_tflops sets the peak")
        if self.kind == "published":
            return head + "FLOPs are over-counted or the figure is wrong; mfu is reported as computed"
        return head + "log.peak_tflops is below what this device runs, or FLOPs are over-counted; mfu is " \
                      "reported as computed"


def device_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name`` for a CUDA device (e.g. ``"NVIDIA H100 80GB HBM3"``), else the device type."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def published_part(name: str) -> str | None:
    """The part of :data:`PUBLISHED_TFLOPS` that GPU ``name`` is, or None when it is none of them for certain.

    A MIG slice (``"... MIG 1g.10gb"``) is None too: it has only part of the device's SMs.
    """
    upper = name.upper()
    if re.search(r"\bMIG\b", upper):
        return None
    for part, must, must_not in _PARTS:
        if re.search(must, upper) and not (must_not and re.search(must_not, upper)):
            return part
    return None


def published_peak(name: str, dtype: torch.dtype) -> PeakFlops | None:
    """The published dense peak of GPU ``name`` in ``dtype``; None for unknown parts and dtypes without one
    (fp32 always: its matmuls may run as TF32 or not, depending on settings)."""
    part = published_part(name)
    precision = _PRECISION_NAMES.get(dtype)
    if part is None or precision not in PUBLISHED_TFLOPS[part]:
        return None
    return PeakFlops(PUBLISHED_TFLOPS[part][precision] * 1e12, f"published {part} {precision}")


# A training step's matmul layouts: forward x @ W^T, input gradient g @ W, weight gradient g^T @ x.
_LAYOUTS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "nt": lambda a, b: a @ b.t(),
    "nn": lambda a, b: a @ b,
    "tn": lambda a, b: a.t() @ b,
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fastest_call(n: int, dtype: torch.dtype, device: torch.device, layout: str, window_s: float) -> float:
    """Seconds of the fastest of several ``n x n x n`` products: at least two, more while within ``window_s``
    (the first call, which may pay one-time set-up, rarely is the fastest)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    fn = _LAYOUTS[layout]
    best, spent, calls = math.inf, 0.0, 0
    while calls < 2 or (spent < window_s and calls < 100):
        _sync(device)
        t0 = time.perf_counter()
        fn(a, b)
        _sync(device)
        dt = time.perf_counter() - t0
        best, spent, calls = min(best, dt), spent + dt, calls + 1
    return best


def measure_layout_rates(dtype: torch.dtype, device: torch.device, *, max_call_s: float = 0.03,
                         window_s: float = 0.005, repeats: int = 3, cache: bool = True) -> dict[str, float]:
    """Best achieved FLOP/s of ``dtype`` matmuls on ``device`` with this process's threads, per layout of
    :data:`_LAYOUTS` (``"nt"``, ``"nn"``, ``"tn"``): on CPUs without native bf16/fp16 instructions they
    differ by 10x and more.

    Each layout is timed at square sizes doubling from 64 (CPU) or 1024 (CUDA): up to 256 (CUDA 4096) at
    least, then on while the rate still improves (two sizes without a 2% gain end it) and the next size's
    one call should take under ``max_call_s``. Then each layout's best size is timed again in
    ``repeats - 1`` further rounds, round-robin over the layouts (a burst of load from elsewhere during
    one round does not hide the peak), and its best over all repetitions is kept. On a CPU one dtype takes
    ~0.1-0.5 s.

    Args:
        dtype: a floating dtype ``torch.matmul`` supports on ``device`` (fp32, bf16, fp16, ...).
        device: where to measure.
        max_call_s: the longest single call (n^3 work: 8x the previous size's) a size past the minimum may take.
        window_s: time spent on repeated calls of one size and layout (at least two are timed).
        repeats: timings of each layout's best size, the size sweep's included (>= 1).
        cache: reuse this process's earlier measurement with the same arguments and thread count.

    Raises:
        RuntimeError: from torch when ``dtype`` has no matmul on ``device``.
        ValueError: ``repeats`` < 1.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    measure = _measured_once if cache else _measure_layout_rates
    return dict(measure(dtype, device, torch.get_num_threads(), max_call_s, window_s, repeats))


@functools.cache
def _measured_once(dtype: torch.dtype, device: torch.device, threads: int, max_call_s: float, window_s: float,
                   repeats: int) -> Mapping[str, float]:
    """:func:`_measure_layout_rates`, once per process for each set of arguments (read-only)."""
    return MappingProxyType(_measure_layout_rates(dtype, device, threads, max_call_s, window_s, repeats))


def _measure_layout_rates(dtype: torch.dtype, device: torch.device, threads: int, max_call_s: float,
                          window_s: float, repeats: int) -> dict[str, float]:
    """:func:`measure_layout_rates` without the cache (``threads``: the thread count it runs with, a cache key)."""
    start, least, largest = (1024, 4096, 8192) if device.type == "cuda" else (64, 256, 4096)
    rates, sizes = {}, {}
    for layout in _LAYOUTS:
        n, best, best_n, stale = start, 0.0, start, 0
        while n <= largest:
            call_s = _fastest_call(n, dtype, device, layout, window_s)
            rate = 2 * n**3 / call_s
            stale = 0 if rate > 1.02 * best else stale + 1
            if rate > best:
                best, best_n = rate, n
            # Below `least` only a hopeless next call stops (a call slowed by waiting for busy cores
            # costs far less than its 8x forecast); past it, a stalled rate or a long call does.
            if 8 * call_s > (8 * max_call_s if n < least else max_call_s) or (n >= least and stale >= 2):
                break
            n *= 2
        rates[layout], sizes[layout] = best, best_n
    for _ in range(repeats - 1):
        for layout, n in sizes.items():
            rates[layout] = max(rates[layout], 2 * n**3 / _fastest_call(n, dtype, device, layout, window_s))
    return rates


def measure_matmul_peak(dtype: torch.dtype, device: torch.device) -> float:
    """Best achieved FLOP/s of ``dtype`` matmuls on ``device``: the fastest layout of
    :func:`measure_layout_rates` (measured once per process, dtype, device and thread count).

    Raises:
        RuntimeError: from torch when ``dtype`` has no matmul on ``device``.
    """
    return max(measure_layout_rates(dtype, device).values())


def _precision_name(dtype: torch.dtype) -> str:
    return _PRECISION_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def peak_flops(dtype: torch.dtype, device: torch.device, *, configured_tflops: float | None = None) -> PeakFlops:
    """The peak FLOP/s per device that ``mfu`` divides by, for a step whose compute dtype is ``dtype``.

    ``configured_tflops`` (``log.peak_tflops``) when given. Else, a CUDA part in :data:`PUBLISHED_TFLOPS`
    with a figure for ``dtype``: that figure. Otherwise the measured :func:`measure_matmul_peak` of ``dtype``,
    or of fp32 where fp32 is faster (a reduced-precision step may run some matmuls in fp32, see the module
    docstring). Called once, before the first step; the peak is not changed afterwards.

    Raises:
        ValueError: ``configured_tflops`` <= 0.
    """
    if configured_tflops is not None:
        if not configured_tflops > 0:
            raise ValueError(f"log.peak_tflops={configured_tflops} must be > 0")
        return PeakFlops(configured_tflops * 1e12, "configured log.peak_tflops")
    if device.type == "cuda":
        published = published_peak(device_name(device), dtype)
        if published is not None:
            return published
    candidates = [dtype] if dtype == torch.float32 else [dtype, torch.float32]
    rates = {d: measure_matmul_peak(d, device) for d in candidates}
    fastest = max(candidates, key=lambda d: rates[d])
    return PeakFlops(rates[fastest], f"measured {_precision_name(fastest)} on {device_name(device)}")


def matmul_speed_vs_fp32(dtype: torch.dtype, device: torch.device) -> float:
    """How fast a training step's matmuls run in ``dtype`` relative to fp32 on ``device`` (1.0 for fp32).

    A step spends equal FLOPs in each layout (per weight: ``x @ W^T`` forward, ``g @ W`` and ``g^T @ x``
    backward), so each dtype's rate is the harmonic mean of its per-layout best rates
    (:func:`measure_layout_rates`), and this is the ratio of the two.
    """
    if dtype == torch.float32:
        return 1.0

    def step_rate(rates: dict[str, float]) -> float:
        return len(rates) / sum(1.0 / r for r in rates.values())

    return step_rate(measure_layout_rates(dtype, device)) / step_rate(measure_layout_rates(torch.float32, device))


def slower_than_fp32_note(precision: Precision, device: torch.device) -> str | None:
    """One line for the start of a run whose precision policy runs matmuls (in its compute dtype) slower than fp32
    here, else None.

    E.g. ``"train.precision=bf16: bf16 matmuls run 0.062x fp32 on this cpu; fp32 would be faster"``
    (bf16 on a CPU without native bf16 matmul instructions, e.g. AVX2 only).
    """
    ratio = matmul_speed_vs_fp32(precision.compute_dtype, device)
    if ratio >= SLOWER_THAN_FP32:
        return None
    name = precision.name
    return (f"train.precision={name}: {name} matmuls run {ratio:.2g}x fp32 on this "
            f"{device_name(device)}; fp32 would be faster")


class CompileClock:
    """Wall seconds this process spent in ``torch.compile`` (tracing and code generation, the lazily compiled
    backward included), from torch's compilation start and end callbacks; ``seconds`` only grows."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started: float | None = None
        try:
            from torch._dynamo.callback import callback_handler
        except ImportError:  # a torch without the callbacks: compile time is counted as step time
            return
        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)

    def _start(self, _: Any) -> None:
        self._started = time.perf_counter()

    def _end(self, _: Any) -> None:
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self._started = None
