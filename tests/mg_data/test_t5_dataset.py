"""T5 samples: span-corruption lengths and statistics, sentinel order, reconstruction, splits, determinism."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from mg_data.blended import BlendedDataset
from mg_data.gpt_indices import parse_split, split_ranges
from mg_data.indexed import IndexedDataset, IndexedDatasetBuilder
from mg_data.masking import random_spans_helper, span_corrupt
from mg_data.t5_dataset import T5Dataset, T5DatasetConfig, build_t5_datasets

EOS, PAD, START = 1, 0, 2
SENTINELS = list(range(999_999, 999_899, -1))  # descending like T5's <extra_id_k>
FIRST_TOKEN = 10


def corpus(path, num_docs=200, seed=0, sentences=False):
    """Documents of distinct tokens (FIRST_TOKEN + global position); optionally split into sentences."""
    rng = np.random.default_rng(seed)
    pos = FIRST_TOKEN
    with IndexedDatasetBuilder(path, np.int32) as b:
        for _ in range(num_docs):
            n = int(rng.integers(0, 120))
            cuts = np.sort(rng.choice(np.arange(1, n), size=min(3, n - 1), replace=False)) if n > 1 else []
            lens = np.diff(np.concatenate([[0], cuts, [n]]).astype(np.int64)).tolist() if n else []
            b.add_document(np.arange(pos, pos + n), sentence_lengths=lens if sentences else None)
            pos += n
    return IndexedDataset(path)


def config(**kw):
    return T5DatasetConfig(**{"encoder_seq_length": 64, "sentinel_ids": SENTINELS, "eos_id": EOS, "pad_id": PAD,
                              "decoder_start_id": START, "seed": 9, **kw})


def decode_sample(s, cfg):
    """(raw tokens rebuilt from encoder input and labels, noise span lengths), checking sentinel order."""
    enc = s["text_enc"][s["enc_mask"] == 1]
    tgt = s["labels"][s["dec_mask"] == 1]
    assert enc[-1] == EOS and tgt[-1] == EOS
    enc, tgt = enc[:-1], tgt[:-1]
    is_sent_e, is_sent_t = np.isin(enc, SENTINELS), np.isin(tgt, SENTINELS)
    k = int(is_sent_e.sum())
    np.testing.assert_array_equal(enc[is_sent_e], SENTINELS[:k])  # sentinels in order, once each
    np.testing.assert_array_equal(tgt[is_sent_t], SENTINELS[:k])
    assert is_sent_t[0]
    spans = np.split(tgt, np.flatnonzero(is_sent_t)[1:])
    raw, j = [], 0
    for e in enc:
        if e in SENTINELS:
            raw += spans[j][1:].tolist()
            j += 1
        else:
            raw.append(int(e))
    return np.array(raw), np.array([len(x) - 1 for x in spans])


def test_random_spans_helper_matches_the_t5_paper_and_is_maximal():
    # T5's published setting: 512 encoder tokens come from 568 raw tokens with 114 targets
    assert random_spans_helper(512, 0.15, 3.0) == (568, 114)
    for target in range(12, 700, 7):
        raw, dec = random_spans_helper(target)
        rng = np.random.default_rng(target)
        enc, tgt = span_corrupt(np.arange(raw) + FIRST_TOKEN, rng, sentinel_ids=SENTINELS, eos_id=EOS)
        assert len(enc) == target and len(tgt) == dec  # encoder length is exactly the target
        longer, _ = span_corrupt(np.arange(raw + 1) + FIRST_TOKEN, rng, sentinel_ids=SENTINELS, eos_id=EOS)
        assert len(longer) > target  # raw is the largest length that fits
    with pytest.raises(ValueError, match="too short"):
        random_spans_helper(4)


def test_lengths_reconstruction_and_noise_statistics(tmp_path):
    ds = corpus(tmp_path / "c", num_docs=300)
    # long samples: with few spans per sample, rounding moves the mean span length away from 3
    cfg = config(encoder_seq_length=512, shuffle=False, split="1")
    t5 = T5Dataset(ds, (0, ds.num_documents), None, cfg)
    stream = np.concatenate([ds.get_document(d) for d in range(ds.num_documents)])
    assert len(t5) == (len(stream) - 1) // cfg.raw_length
    noise = spans = raw_total = 0
    span_lengths = []
    for i in range(len(t5)):
        s = t5[i]
        assert {k: (v.dtype, v.shape) for k, v in s.items()} == {
            "text_enc": (np.int64, (512,)), "text_dec": (np.int64, (cfg.decoder_length,)),
            "labels": (np.int64, (cfg.decoder_length,)), "loss_mask": (np.float32, (cfg.decoder_length,)),
            "enc_mask": (np.int64, (512,)), "dec_mask": (np.int64, (cfg.decoder_length,))}
        assert s["enc_mask"].all() and s["dec_mask"].all() and s["loss_mask"].all()
        assert s["text_dec"][0] == START
        np.testing.assert_array_equal(s["text_dec"][1:], s["labels"][:-1])
        raw, lens = decode_sample(s, cfg)
        np.testing.assert_array_equal(raw, stream[i * cfg.raw_length:(i + 1) * cfg.raw_length])
        assert s["enc_mask"].sum() == cfg.raw_length - lens.sum() + len(lens) + 1
        noise += lens.sum()
        spans += len(lens)
        raw_total += len(raw)
        span_lengths += lens.tolist()
    assert noise / raw_total == pytest.approx(0.15, abs=0.01)
    assert noise / spans == pytest.approx(3.0, abs=0.1)
    assert min(span_lengths) >= 1 and max(span_lengths) > 3  # spans vary in length
    # noise positions vary between samples
    first_span_start = {int(np.flatnonzero(np.isin(t5[i]["text_enc"], SENTINELS))[0]) for i in range(len(t5))}
    assert len(first_span_start) > 5


def test_fixed_decoder_length_pads_decoder_arrays(tmp_path):
    ds = corpus(tmp_path / "c")
    cfg = config(decoder_seq_length=random_spans_helper(64)[1] + 5)
    s = T5Dataset(ds, (0, ds.num_documents), None, cfg)[0]
    assert s["enc_mask"].all()
    assert len(s["text_dec"]) == cfg.decoder_length + 5 and s["dec_mask"].sum() == cfg.decoder_length
    assert (s["labels"][-5:] == -100).all() and (s["loss_mask"][-5:] == 0).all() and (s["text_dec"][-4:] == PAD).all()


def test_splits_never_cross_and_each_token_once_per_epoch(tmp_path):
    ds = corpus(tmp_path / "c", num_docs=300, sentences=True)
    cfg = config(split="70,20,10", cache_dir=str(tmp_path / "cache"))
    splits = build_t5_datasets(cfg, [str(tmp_path / "c")])
    ranges = split_ranges(ds.num_documents, parse_split("70,20,10"))
    for split_ds, (d0, d1) in zip(splits, ranges):
        allowed = set(np.concatenate([ds.get_document(d) for d in range(d0, d1)]).tolist())
        seen = []
        for i in range(len(split_ds)):
            raw, _ = decode_sample(split_ds[i], cfg)
            seen += raw.tolist()
        assert set(seen) <= allowed and len(seen) == len(set(seen))
        assert len(seen) > 0.8 * len(allowed)
    again = build_t5_datasets(cfg, [str(tmp_path / "c")])
    assert not again[0].built_index
    blob = pickle.dumps(splits[0])  # with a cache, workers re-map the index files instead of copying them
    assert len(blob) < splits[0].sample_index.nbytes
    np.testing.assert_array_equal(pickle.loads(blob)[3]["text_enc"], splits[0][3]["text_enc"])
    corpus(tmp_path / "d", seed=1)
    blend = build_t5_datasets(cfg, ["0.5", str(tmp_path / "c"), "0.5", str(tmp_path / "d")], num_samples=(100, 10, 10))
    assert isinstance(blend[0], BlendedDataset) and len(blend[0]) == 100
    assert sum(int(blend[0][i]["dataset_id"]) for i in range(100)) == 50


def test_determinism_from_seed_and_index(tmp_path):
    ds = corpus(tmp_path / "c")
    one = T5Dataset(ds, (0, ds.num_documents), 50, config())
    two = T5Dataset(ds, (0, ds.num_documents), 50, config())
    other = T5Dataset(ds, (0, ds.num_documents), 50, config(seed=10))
    for i in range(20):
        assert all(np.array_equal(one[i][k], two[i][k]) for k in one[i])
        assert not np.array_equal(one[i]["text_enc"], one[i + 1]["text_enc"])
        assert not np.array_equal(one[i]["text_enc"], other[i]["text_enc"])


def test_config_errors():
    with pytest.raises(ValueError, match="sentinel_ids"):
        config(sentinel_ids=SENTINELS[:2])  # 64 encoder tokens hold 3 spans
    with pytest.raises(ValueError, match="decoder_seq_length"):
        config(decoder_seq_length=4)
    with pytest.raises(ValueError, match="distinct"):
        config(sentinel_ids=[5] * 100)
