"""Weighted, deterministic mixtures of sample datasets."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from mg_data.index_cache import cached_arrays, fingerprint

_BLEND_VERSION = 2  # bumped whenever the interleaving algorithm changes


class SampleDataset(Protocol):
    """What a blended component must offer."""

    def __len__(self) -> int: ...

    def __getitem__(self, idx: int) -> Any: ...


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic weighted interleaving of ``size`` samples (Tijdeman's chairman assignment).

    With ``K`` datasets and ``s = 1 - 1/(2K-2)``: sample ``n`` goes, among the datasets whose
    count lags its target ``weights[k] * n`` by at least ``1 - s``, to the one whose target
    reaches ``count + s`` first (lowest index on ties). After every prefix each dataset is then
    within ``s < 1`` samples of its target (R. Tijdeman, "The chairman assignment problem",
    1980); the plain largest-deficit greedy can drift past one sample with many datasets.

    Args:
        weights: non-negative weights summing to 1.
        size: number of samples.

    Returns:
        (dataset_index int16 of shape (size,), dataset_sample_index int64 of shape (size,)): which
        dataset serves sample ``i`` and which of its samples it is.
    """
    w = [float(x) for x in weights]
    k_count = len(w)
    counts = [0] * k_count
    which = array("h", bytes(2 * size))
    nth = array("q", bytes(8 * size))
    if k_count == 1:
        return np.zeros(size, dtype=np.int16), np.arange(size, dtype=np.int64)
    s = 1.0 - 1.0 / (2 * k_count - 2)
    threshold = 1.0 - s - 1e-9  # tolerance for float rounding of weights[k] * n
    inv = [1.0 / x if x > 0 else float("inf") for x in w]
    ks = range(k_count)
    for i in range(size):
        n = i + 1
        best, deadline = -1, float("inf")
        for k in ks:
            if w[k] * n - counts[k] >= threshold:
                d = (counts[k] + s) * inv[k]
                if d < deadline:
                    best, deadline = k, d
        if best < 0:  # unreachable in exact arithmetic; fall back to the largest deficit
            best = max(ks, key=lambda k: w[k] * n - counts[k])
        which[i] = best
        nth[i] = counts[best]
        counts[best] += 1
    return np.frombuffer(which, dtype=np.int16).copy(), np.frombuffer(nth, dtype=np.int64).copy()


class BlendedDataset:
    """``size`` samples mixed from ``datasets`` in proportion to ``weights`` (deterministic).

    ``ds[i]`` is ``datasets[dataset_index[i]][dataset_sample_index[i]]``; with a sample dict, the
    key ``dataset_id`` is added. The interleaving is cached like the GPT indices.

    Args:
        datasets: components; each must hold at least ``required_samples(weights, size)[k]`` samples.
        weights: non-negative mixture weights (normalised here).
        size: number of samples.
        cache_dir: where to cache the interleaving; None builds it in memory.
        name: readable cache-file stem.

    Raises:
        ValueError: mismatched lengths, bad weights, or a component with too few samples.
    """

    def __init__(self, datasets: Sequence[SampleDataset], weights: Sequence[float], size: int, *,
                 cache_dir: str | None = None, name: str = "blend") -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"need one weight per dataset, got {len(weights)} weights for {len(datasets)} datasets")
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"blend weights {list(weights)} must be non-negative with a positive sum")
        if len(datasets) > 32767:
            raise ValueError("at most 32767 datasets can be blended")
        self.datasets = list(datasets)
        self.weights = [float(w) / sum(weights) for w in weights]
        self.size = size
        parts = [getattr(d, "cache_key", f"{type(d).__name__}:{len(d)}") for d in datasets]
        key = fingerprint(_BLEND_VERSION, self.weights, size, parts)

        def build() -> dict[str, np.ndarray]:
            a, b = build_blending_indices(self.weights, size)
            return {"dataset_index": a, "dataset_sample_index": b}

        arrays, self.built_index = cached_arrays(cache_dir, f"blend-{name}", key,
                                                 ("dataset_index", "dataset_sample_index"), build,
                                                 {"weights": self.weights, "size": size})
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        need = np.bincount(np.asarray(self.dataset_index), minlength=len(datasets))
        for k, (d, n) in enumerate(zip(datasets, need)):
            if len(d) < n:
                raise ValueError(f"blended dataset {k} has {len(d)} samples but the blend needs {int(n)}; "
                                 "build it with num_samples from BlendedDataset.required_samples")

    @staticmethod
    def required_samples(weights: Sequence[float], size: int) -> list[int]:
        """Samples each component must provide for a blend of ``size`` samples."""
        total = sum(weights)
        a, _ = build_blending_indices([w / total for w in weights], size)
        return [int(x) for x in np.bincount(a, minlength=len(weights))]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> Any:
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range [0, {self.size}) of the blend")
        k = int(self.dataset_index[idx])
        sample = self.datasets[k][int(self.dataset_sample_index[idx])]
        if isinstance(sample, dict):
            sample = {**sample, "dataset_id": np.int64(k)}
        return sample
