"""Weighted, deterministic mixtures of sample datasets."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from mg_data.index_cache import cached_arrays, fingerprint

_BLEND_VERSION = 1


class SampleDataset(Protocol):
    """What a blended component must offer."""

    def __len__(self) -> int: ...

    def __getitem__(self, idx: int) -> Any: ...


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy weighted interleaving of ``size`` samples.

    Sample ``i`` goes to the dataset whose count lags its target ``weights[k] * (i + 1)`` the most
    (lowest index on ties), so after any prefix every dataset is within one sample of its target.

    Returns:
        (dataset_index int16 of shape (size,), dataset_sample_index int64 of shape (size,)): which
        dataset serves sample ``i`` and which of its samples it is.
    """
    w = [float(x) for x in weights]
    k_range = range(1, len(w))
    counts = [0] * len(w)
    which = array("h", bytes(2 * size))
    nth = array("q", bytes(8 * size))
    for i in range(size):
        t = i + 1
        best, bv = 0, w[0] * t - counts[0]
        for k in k_range:
            v = w[k] * t - counts[k]
            if v > bv:
                best, bv = k, v
        which[i] = best
        nth[i] = counts[best]
        counts[best] += 1
    return np.frombuffer(which, dtype=np.int16).copy(), np.frombuffer(nth, dtype=np.int64).copy()


class BlendedDataset:
    """``size`` samples mixed from ``datasets`` in proportion to ``weights`` (greedy, deterministic).

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
