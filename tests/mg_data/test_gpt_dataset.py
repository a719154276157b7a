"""GPT samples: split/epoch/shuffle properties, masks against a loop reference, index caching."""

from __future__ import annotations

import multiprocessing as mp
import pickle
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest

from mg_data.gpt_dataset import GPTDataset, GPTDatasetConfig, build_gpt_datasets, make_sample
from mg_data.gpt_indices import build_sample_index, parse_split, split_ranges
from mg_data.indexed import IndexedDataset, IndexedDatasetBuilder


def unique_token_corpus(path, num_docs=300, seed=0, max_len=60):
    """Documents whose tokens are all distinct (token = global position), some of length 0."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, max_len, size=num_docs)
    pos = 0
    with IndexedDatasetBuilder(path, np.int32) as b:
        for n in lengths:
            b.add_document(np.arange(pos, pos + n))
            pos += n
    return IndexedDataset(path)


def doc_tokens(ds, d0, d1):
    return set(np.concatenate([ds.get_document(d) for d in range(d0, d1)]).tolist())


def test_split_parsing_and_ranges():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("98/2") == pytest.approx([0.98, 0.02, 0.0])
    assert split_ranges(1000, parse_split("969,30,1")) == [(0, 969), (969, 999), (999, 1000)]
    r = split_ranges(7, parse_split("1,1,1"))
    assert r[0][0] == 0 and r[-1][1] == 7 and all(a[1] == b[0] for a, b in zip(r, r[1:]))
    for bad in ("a,b", "-1,2", "0,0,0", "1,2,3,4"):
        with pytest.raises(ValueError, match="split"):
            parse_split(bad)


def test_one_epoch_uses_every_token_once_and_never_crosses_splits(tmp_path):
    ds = unique_token_corpus(tmp_path / "u")
    cfg = GPTDatasetConfig(seq_length=16, seed=3, split="80,20,0")
    train, valid, test = build_gpt_datasets(cfg, [str(tmp_path / "u")])
    assert test is None
    ranges = split_ranges(ds.num_documents, parse_split("80,20,0"))
    for split_ds, (d0, d1) in zip((train, valid), ranges):
        allowed = doc_tokens(ds, d0, d1)
        inputs = Counter()
        for i in range(len(split_ds)):
            s = split_ds[i]
            np.testing.assert_array_equal(s["labels"][:-1], s["tokens"][1:])
            assert set(s["tokens"].tolist()) | set(s["labels"].tolist()) <= allowed
            inputs.update(s["tokens"].tolist())
        assert max(inputs.values()) == 1  # no input token twice in one epoch
        assert len(split_ds) == (len(allowed) - 1) // 16
        assert len(allowed) - len(inputs) <= 16  # only the tail shorter than a sample is left out
    # the shuffled order differs from corpus order, and a second build with the same seed is identical
    again = build_gpt_datasets(cfg, [str(tmp_path / "u")])[0]
    assert np.array_equal(np.asarray(train.shuffle_index), np.asarray(again.shuffle_index))
    assert not np.array_equal(np.asarray(train.shuffle_index), np.arange(len(train)))
    ordered = GPTDataset(ds, ranges[0], None, GPTDatasetConfig(seq_length=16, shuffle=False), "train")
    flat = np.concatenate([ds.get_document(d) for d in range(*ranges[0])])
    for i in (0, 5, len(ordered) - 1):
        np.testing.assert_array_equal(ordered.sample_tokens(i), flat[i * 16:i * 16 + 17])


def test_several_epochs_and_separate_final_epoch(tmp_path):
    ds = unique_token_corpus(tmp_path / "u")
    total = ds.num_tokens
    per_epoch = (total - 1) // 32
    n = 2 * per_epoch + per_epoch // 10  # a short third epoch: shuffled apart
    g = GPTDataset(ds, (0, ds.num_documents), n, GPTDatasetConfig(seq_length=32, seed=1), "train")
    assert len(g) >= n
    counts = Counter()
    for i in range(len(g)):
        counts.update(g.sample_tokens(i)[:-1].tolist())
    assert max(counts.values()) == 3 and set(counts) == set(range(total))
    doc = np.asarray(g.document_index)
    d = ds.num_documents
    # the first two epochs are shuffled together, the third alone: each holds every document
    assert sorted(doc[:2 * d].tolist()) == sorted(list(range(d)) * 2)
    assert sorted(doc[2 * d:].tolist()) == list(range(d))
    sans_final = (2 * total - 1) // 32
    shuf = np.asarray(g.shuffle_index)
    assert sorted(shuf[:sans_final].tolist()) == list(range(sans_final))
    joint = GPTDataset(ds, (0, ds.num_documents), n,
                       GPTDatasetConfig(seq_length=32, seed=1, separate_final_epoch_threshold=0.0), "train")
    jdoc = np.asarray(joint.document_index)
    assert sorted(jdoc.tolist()) == sorted(list(range(d)) * 3)
    assert sorted(jdoc[2 * d:].tolist()) != list(range(d))  # all three epochs shuffled together


def test_sample_index_handles_empty_documents_and_exact_boundaries():
    lengths = np.array([0, 4, 0, 0, 4, 4, 0, 1])
    s = build_sample_index(lengths, 4, 3)
    # positions 0, 4, 8, 12 -> (doc position, offset); empty documents are never pointed at
    assert s.tolist() == [[1, 0], [4, 0], [5, 0], [7, 0]]
    with pytest.raises(ValueError, match="need more than"):
        build_sample_index(lengths, 4, 4)


def reference_masks(tokens, eod, reset_pos, reset_attn, mask_eod):
    """Megatron-style left-to-right masks computed with plain loops."""
    s = len(tokens)
    loss = [1.0] * s
    pos = list(range(s))
    allowed = [[j <= i for j in range(s)] for i in range(s)]
    prev = 0
    for i, t in enumerate(tokens):
        if t == eod:
            if mask_eod:
                loss[i] = 0.0
            if reset_attn:
                for a in range(i + 1, s):
                    for b in range(0, i + 1):
                        allowed[a][b] = False
            if reset_pos:
                for a in range(i + 1, s):
                    pos[a] -= i + 1 - prev
                prev = i + 1
    return np.array(loss, np.float32), np.array(pos), ~np.array(allowed)[None]


def test_masks_match_loop_reference():
    rng = np.random.default_rng(0)
    for _ in range(20):
        text = rng.integers(0, 5, size=13)  # eod=0 appears often, sometimes first or last
        for flags in [(True, True, True), (False, True, False), (True, False, True), (False, False, False)]:
            cfg = GPTDatasetConfig(seq_length=12, eod_id=0, reset_position_ids=flags[0],
                                   reset_attention_mask=flags[1], eod_mask_loss=flags[2],
                                   create_attention_mask=True)
            out = make_sample(text, cfg)
            loss, pos, attn = reference_masks(text[:-1].tolist(), 0, *flags)
            np.testing.assert_array_equal(out["tokens"], text[:-1])
            np.testing.assert_array_equal(out["labels"], text[1:])
            np.testing.assert_array_equal(out["loss_mask"], loss)
            np.testing.assert_array_equal(out["position_ids"], pos)
            np.testing.assert_array_equal(out["attention_mask"], attn)
    plain = make_sample(np.arange(9), GPTDatasetConfig(seq_length=8))
    assert "attention_mask" not in plain and plain["tokens"].dtype == np.int64
    with pytest.raises(ValueError, match="eod_id is required"):
        GPTDatasetConfig(seq_length=8, eod_mask_loss=True)


def test_cache_reused_and_invalidated(tmp_path):
    unique_token_corpus(tmp_path / "u")
    cache = tmp_path / "cache"
    cfg = GPTDatasetConfig(seq_length=16, cache_dir=str(cache))
    a = build_gpt_datasets(cfg, [str(tmp_path / "u")], (500, None, None))[0]
    b = build_gpt_datasets(cfg, [str(tmp_path / "u")], (500, None, None))[0]
    assert a.built_index and not b.built_index
    assert np.array_equal(np.asarray(a.sample_index), np.asarray(b.sample_index))
    assert len(list(cache.glob("gpt-u-train-*-sample_index.npy"))) == 1 and not b.sample_index.flags.owndata
    blob = pickle.dumps(b)  # what a spawned DataLoader worker receives: paths, not arrays
    assert len(blob) < 4096
    c = pickle.loads(blob)
    for i in (0, 7, 499):
        for k, v in b[i].items():
            np.testing.assert_array_equal(c[i][k], v)
    c = build_gpt_datasets(GPTDatasetConfig(seq_length=16, cache_dir=str(cache), seed=7), [str(tmp_path / "u")],
                           (500, None, None))[0]
    assert c.built_index
    d = build_gpt_datasets(cfg, [str(tmp_path / "u")], (600, None, None))[0]
    assert d.built_index
    unique_token_corpus(tmp_path / "u", seed=1)  # same prefix, different content
    e = build_gpt_datasets(cfg, [str(tmp_path / "u")], (500, None, None))[0]
    assert e.built_index and e.cache_key != a.cache_key
    assert not list(cache.glob("*.lock")) and not list(cache.glob("*.tmp-*"))


def build_in_worker(prefix, cache, barrier):
    barrier.wait()
    cfg = GPTDatasetConfig(seq_length=8, cache_dir=cache)
    g = build_gpt_datasets(cfg, [prefix], (20_000, None, None))[0]
    return g.built_index, [np.asarray(x).tobytes() for x in (g.document_index, g.sample_index, g.shuffle_index)]


def test_concurrent_cache_build_by_four_processes(tmp_path):
    unique_token_corpus(tmp_path / "u", num_docs=3000, max_len=200)
    ctx = mp.get_context("fork")  # fast start; the processes share nothing but the cache directory
    with ctx.Manager() as manager, ProcessPoolExecutor(4, mp_context=ctx) as pool:
        barrier = manager.Barrier(4)
        results = list(pool.map(build_in_worker, [str(tmp_path / "u")] * 4, [str(tmp_path / "c")] * 4,
                                [barrier] * 4))
    assert sum(built for built, _ in results) == 1
    assert all(arrays == results[0][1] for _, arrays in results)
    cfg = GPTDatasetConfig(seq_length=8)  # no cache: an independent in-memory build
    ref = build_gpt_datasets(cfg, [str(tmp_path / "u")], (20_000, None, None))[0]
    assert results[0][1][1] == np.asarray(ref.sample_index).tobytes()


def test_sentence_level_corpus_splits_by_document(tmp_path):
    """Documents of several sequences: a split takes whole documents; samples run through sentences."""
    with IndexedDatasetBuilder(tmp_path / "s", np.int32) as b:
        pos = 0
        for d in range(40):
            sents = [3, 5, 2] if d % 2 else [4]
            b.add_document(np.arange(pos, pos + sum(sents)), sents)
            pos += sum(sents)
    ds = IndexedDataset(tmp_path / "s")
    train, valid, _ = build_gpt_datasets(GPTDatasetConfig(seq_length=5, split="3,1,0", shuffle=False),
                                         [str(tmp_path / "s")])
    assert train.sequence_range == (0, int(ds.document_indices[30])) == (0, 60)
    assert valid.sequence_range == (60, len(ds))
    flat = np.concatenate(ds[0:60])
    for i in range(len(train)):
        np.testing.assert_array_equal(train.sample_tokens(i), flat[i * 5:i * 5 + 6])
