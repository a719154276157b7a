"""Blending: greedy ratios within one sample of target at every prefix, determinism, caching, GPT blends."""

from __future__ import annotations

import numpy as np
import pytest

from mg_data.blended import BlendedDataset, build_blending_indices
from mg_data.gpt_dataset import GPTDataset, GPTDatasetConfig, build_gpt_datasets, parse_blend
from mg_data.indexed import IndexedDatasetBuilder


def random_weights(seed):
    rng = np.random.default_rng(seed)
    w = rng.random(int(rng.integers(2, 12))) ** 3  # skewed, some tiny
    return (w / w.sum()).tolist()


@pytest.mark.parametrize("weights", [[0.5, 0.5], [0.7, 0.2, 0.1], [0.01, 0.99], [0.3, 0.3, 0.2, 0.1, 0.05, 0.05],
                                     [0.5, 0.0, 0.5]] + [random_weights(s) for s in range(12)])
def test_prefix_error_below_one_sample(weights):
    size = 3000
    which, nth = build_blending_indices(weights, size)
    k = len(weights)
    onehot = np.zeros((size, k))
    onehot[np.arange(size), which] = 1
    counts = np.cumsum(onehot, axis=0)  # samples of each dataset after each prefix
    target = np.arange(1, size + 1)[:, None] * np.array(weights)[None]
    assert np.abs(counts - target).max() <= 1 - 1 / (2 * k - 2) + 1e-9 < 1
    # the k-th time dataset d is chosen it serves its sample k
    for d in range(k):
        np.testing.assert_array_equal(nth[which == d], np.arange((which == d).sum()))
    again, _ = build_blending_indices(weights, size)
    np.testing.assert_array_equal(again, which)


class Numbers:
    def __init__(self, tag, n):
        self.tag, self.n = tag, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"value": np.array([self.tag, i])}


def test_blended_dataset_serves_components_and_checks_sizes(tmp_path):
    need = BlendedDataset.required_samples([3, 1], 100)
    assert need == [75, 25]
    blend = BlendedDataset([Numbers(0, 75), Numbers(1, 25)], [3, 1], 100, cache_dir=str(tmp_path))
    seen = [tuple(blend[i]["value"].tolist()) for i in range(100)]
    assert sorted(seen) == [(0, i) for i in range(75)] + [(1, i) for i in range(25)]
    assert blend[0]["dataset_id"] == 0 and blend.built_index
    again = BlendedDataset([Numbers(0, 75), Numbers(1, 25)], [3, 1], 100, cache_dir=str(tmp_path))
    assert not again.built_index and np.array_equal(again.dataset_index, blend.dataset_index)
    with pytest.raises(ValueError, match="has 20 samples but the blend needs 25"):
        BlendedDataset([Numbers(0, 75), Numbers(1, 20)], [3, 1], 100)
    with pytest.raises(IndexError):
        blend[100]


def test_gpt_blend_from_prefixes(tmp_path):
    rng = np.random.default_rng(0)
    for name, base in (("a", 0), ("b", 1_000_000)):
        with IndexedDatasetBuilder(tmp_path / name, np.int32) as b:
            for _ in range(200):
                b.add_document(base + rng.integers(0, 1000, size=rng.integers(10, 50)))
    assert parse_blend(["0.25", str(tmp_path / "a"), "0.75", str(tmp_path / "b")])[1] == [0.25, 0.75]
    cfg = GPTDatasetConfig(seq_length=8, split="90,10,0", cache_dir=str(tmp_path / "cache"))
    blend = [0.25, str(tmp_path / "a"), 0.75, str(tmp_path / "b")]
    train, valid, test = build_gpt_datasets(cfg, blend, (400, 40, None))
    assert isinstance(train, BlendedDataset) and len(train) == 400 and test is None
    ids = np.array([train[i]["dataset_id"] for i in range(400)])
    assert abs((ids == 0).sum() - 100) <= 1
    for i in range(400):  # samples of dataset b carry its token range
        s = train[i]
        assert (s["tokens"] >= 1_000_000).all() == (s["dataset_id"] == 1)
    assert isinstance(train.datasets[0], GPTDataset)
    per_split = build_gpt_datasets(cfg, None, (50, None, None), blend_per_split=[blend, [str(tmp_path / "a")], None])
    assert len(per_split[0]) == 50 and isinstance(per_split[1], GPTDataset) and per_split[2] is None
    with pytest.raises(ValueError, match="needs num_samples"):
        build_gpt_datasets(cfg, blend, (None, None, None))
    with pytest.raises(ValueError, match="pairs"):
        parse_blend(["0.5", "a", "0.5"])
