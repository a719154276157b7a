"""BERT samples: masking statistics, whole-word masking, segment pairs, SOP/NSP balance, splits, determinism."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from mg_data.bert_dataset import (
    BertDataset,
    BertDatasetConfig,
    build_bert_datasets,
    build_bert_samples,
    truncate_pair,
)
from mg_data.blended import BlendedDataset
from mg_data.gpt_indices import parse_split, split_ranges
from mg_data.indexed import IndexedDataset, IndexedDatasetBuilder
from mg_data.masking import mask_tokens
from mg_data.preprocess import PreprocessConfig, run_preprocess
from mg_data.tokenizers import build_tokenizer, train_sentencepiece

CLS, SEP, MASK, PAD = 0, 1, 2, 3
FIRST_TOKEN = 10  # corpus tokens start above the special ids


def sentence_corpus(path, num_docs=200, seed=0, max_sentences=8, max_len=40):
    """Sentence-split corpus whose tokens are all distinct (token = FIRST_TOKEN + global position)."""
    rng = np.random.default_rng(seed)
    pos = FIRST_TOKEN
    with IndexedDatasetBuilder(path, np.int32) as b:
        for _ in range(num_docs):
            lens = rng.integers(1, max_len, size=int(rng.integers(1, max_sentences + 1)))
            b.add_document(np.arange(pos, pos + lens.sum()), sentence_lengths=lens.tolist())
            pos += int(lens.sum())
    return IndexedDataset(path), pos


def config(vocab, **kw):
    return BertDatasetConfig(**{"max_seq_length": 64, "vocab_size": vocab, "cls_id": CLS, "sep_id": SEP,
                                "mask_id": MASK, "pad_id": PAD, "seed": 5, **kw})


def original(sample):
    """The tokens before masking: labels hold the original id wherever a token was chosen."""
    return np.where(sample["labels"] != -100, sample["labels"], sample["text"])


def segments(sample):
    """(A, B) original tokens, from the [SEP] positions."""
    tok = original(sample)[sample["padding_mask"] == 1]
    seps = np.flatnonzero(tok == SEP)
    return tok[1:seps[0]], tok[seps[0] + 1:seps[1]] if len(seps) > 1 else tok[:0]


def test_mask_tokens_rates_on_100k_tokens():
    vocab = 50_000
    chosen = masked = unchanged = rand = cands = 0
    for i in range(200):
        rng = np.random.default_rng((7, i))
        toks = np.concatenate([[CLS], rng.integers(FIRST_TOKEN, vocab, 250), [SEP], rng.integers(FIRST_TOKEN, vocab, 247),
                               [SEP]])
        out, labels = mask_tokens(toks, rng, vocab_size=vocab, mask_id=MASK, special_ids=(CLS, SEP))
        sel = labels != -100
        assert not sel[toks < FIRST_TOKEN].any()  # specials are never chosen
        np.testing.assert_array_equal(labels[sel], toks[sel])
        np.testing.assert_array_equal(out[~sel], toks[~sel])
        cands += 497
        chosen += sel.sum()
        masked += (out[sel] == MASK).sum()
        unchanged += (out[sel] == toks[sel]).sum()
        rand += ((out[sel] != MASK) & (out[sel] != toks[sel])).sum()
    assert cands == 99_400
    assert chosen / cands == pytest.approx(0.15, abs=0.002)
    assert masked / chosen == pytest.approx(0.8, abs=0.015)
    assert unchanged / chosen == pytest.approx(0.1, abs=0.012)
    assert rand / chosen == pytest.approx(0.1, abs=0.012)


def test_truncate_pair_matches_token_by_token_loop():
    def loop(a, b, m):
        while a + b > m:
            if a > b:
                a -= 1
            else:
                b -= 1
        return a, b

    for a in range(0, 30):
        for b in range(0, 30):
            for m in (1, 7, 20, 40):
                assert truncate_pair(a, b, m) == loop(a, b, m), (a, b, m)


def test_samples_mapping_runs_of_one_document(tmp_path):
    ds, _ = sentence_corpus(tmp_path / "s")
    di = ds.document_indices
    lengths = np.asarray(ds.sequence_lengths)
    rows = build_bert_samples(lengths, di, 0, max_num_tokens=61, short_seq_prob=0.1, min_sentences=2,
                              num_samples=None, seed=1)
    doc_of = np.searchsorted(di, rows[:, 0], side="right") - 1
    assert (rows[:, 1] <= di[doc_of + 1]).all() and (rows[:, 1] - rows[:, 0] >= 2).all()
    # one epoch covers each sentence of every document with >= 2 sentences exactly once
    covered = np.concatenate([np.arange(s, e) for s, e, _ in rows])
    usable = np.concatenate([np.arange(di[d], di[d + 1]) for d in range(len(di) - 1) if di[d + 1] - di[d] >= 2])
    np.testing.assert_array_equal(np.sort(covered), usable)
    more = build_bert_samples(lengths, di, 0, 61, 0.1, 2, num_samples=3 * len(rows), seed=1)
    assert len(more) >= 3 * len(rows)


def test_pairs_types_padding_and_sop_balance(tmp_path):
    ds, vocab = sentence_corpus(tmp_path / "s", num_docs=400)
    bert = BertDataset(ds, (0, ds.num_documents), None, config(vocab))
    assert len(bert) > 500
    swapped = 0
    for i in range(len(bert)):
        s = bert[i]
        assert {k: v.dtype for k, v in s.items()} == {
            "text": np.int64, "types": np.int64, "labels": np.int64, "is_random": np.int64,
            "loss_mask": np.float32, "padding_mask": np.int64, "truncated": np.int64}
        assert all(s[k].shape == (64,) for k in ("text", "types", "labels", "loss_mask", "padding_mask"))
        n = int(s["padding_mask"].sum())
        assert (s["padding_mask"][:n] == 1).all() and (s["text"][n:] == PAD).all() and (s["labels"][n:] == -100).all()
        np.testing.assert_array_equal(s["loss_mask"], (s["labels"] != -100).astype(np.float32))
        a, b = segments(s)
        assert len(a) and len(b) and len(a) + len(b) + 3 == n
        assert s["text"][0] == CLS and s["text"][len(a) + 1] == SEP and s["text"][n - 1] == SEP
        np.testing.assert_array_equal(s["types"], np.r_[np.zeros(len(a) + 2), np.ones(len(b) + 1), np.zeros(64 - n)])
        first, second = (b, a) if s["is_random"] else (a, b)
        if not s["truncated"]:  # consecutive sentences of one document, in order unless swapped
            np.testing.assert_array_equal(np.concatenate([first, second]),
                                          np.arange(first[0], first[0] + len(a) + len(b)))
        else:
            assert (np.diff(first) == 1).all() and (np.diff(second) == 1).all() and first[-1] < second[0]
        swapped += int(s["is_random"])
    assert swapped / len(bert) == pytest.approx(0.5, abs=0.06)


def test_nsp_random_segment_comes_from_another_document_of_the_split(tmp_path):
    ds, vocab = sentence_corpus(tmp_path / "s", num_docs=300)
    cfg = config(vocab, sentence_task="nsp", split="50,50,0")
    train, valid, _ = build_bert_datasets(cfg, [str(tmp_path / "s")])
    di = ds.document_indices
    starts = [ds.sequence_pointers[di[d]] // 4 for d in range(ds.num_documents)]

    def doc_of(token):
        return int(np.searchsorted(np.asarray(starts) + FIRST_TOKEN, token, side="right")) - 1

    ranges = split_ranges(ds.num_documents, parse_split("50,50,0"))
    for split_ds, (d0, d1) in zip((train, valid), ranges):
        randoms = 0
        for i in range(len(split_ds)):
            s = split_ds[i]
            a, b = segments(s)
            da, db = doc_of(a[0]), doc_of(b[0])
            assert d0 <= da < d1 and d0 <= db < d1
            assert (da != db) == bool(s["is_random"])
            randoms += int(s["is_random"])
        assert randoms / len(split_ds) == pytest.approx(0.5, abs=0.08)


def test_no_sample_crosses_splits_and_blending(tmp_path):
    ds, vocab = sentence_corpus(tmp_path / "s", num_docs=300)
    sentence_corpus(tmp_path / "t", num_docs=100, seed=1)
    cfg = config(vocab, split="60,20,20", cache_dir=str(tmp_path / "cache"))
    splits = build_bert_datasets(cfg, [str(tmp_path / "s")])
    ranges = split_ranges(ds.num_documents, parse_split("60,20,20"))
    for split_ds, (d0, d1) in zip(splits, ranges):
        allowed = set(np.concatenate([ds.get_document(d) for d in range(d0, d1)]).tolist())
        for i in range(len(split_ds)):
            a, b = segments(split_ds[i])
            assert set(a.tolist()) | set(b.tolist()) <= allowed
    again = build_bert_datasets(cfg, [str(tmp_path / "s")])
    assert not again[0].built_index and again[0].samples.tolist() == splits[0].samples.tolist()
    blob = pickle.dumps(splits[0])  # with a cache, workers re-map the index file instead of copying it
    assert len(blob) < splits[0].samples.nbytes
    np.testing.assert_array_equal(pickle.loads(blob)[3]["text"], splits[0][3]["text"])
    blend = build_bert_datasets(cfg, ["0.7", str(tmp_path / "s"), "0.3", str(tmp_path / "t")], num_samples=(300, 20, 20))
    assert isinstance(blend[0], BlendedDataset) and len(blend[0]) == 300
    ids = np.array([int(blend[0][i]["dataset_id"]) for i in range(300)])
    assert (ids == 0).mean() == pytest.approx(0.7, abs=0.01)


def test_determinism_from_seed_and_index(tmp_path):
    ds, vocab = sentence_corpus(tmp_path / "s")
    one = BertDataset(ds, (0, ds.num_documents), None, config(vocab))
    two = pickle.loads(pickle.dumps(BertDataset(ds, (0, ds.num_documents), None, config(vocab))))
    other_seed = BertDataset(ds, (0, ds.num_documents), None, config(vocab, seed=6))
    for i in range(20):
        x, y = one[i], two[i]
        assert all(np.array_equal(x[k], y[k]) for k in x)
        assert not np.array_equal(one[i]["text"], one[i + 1]["text"])
        assert not np.array_equal(one[i]["text"], other_seed[i]["text"])


def test_config_errors():
    with pytest.raises(ValueError, match="mask_id"):
        BertDatasetConfig(max_seq_length=64, vocab_size=100, cls_id=0, sep_id=1, mask_id=None, pad_id=3)
    with pytest.raises(ValueError, match="sentence_task"):
        config(100, sentence_task="mlm")
    with pytest.raises(ValueError, match="mask_prob"):
        config(100, mask_prob=0.95)


@pytest.fixture(scope="module")
def sp_with_specials(corpus, tmp_path_factory):
    """The documented way to get [CLS]/[SEP]/[MASK]/pad ids from a SentencePiece model."""
    out = tmp_path_factory.mktemp("tokb") / "sp"
    model = train_sentencepiece([corpus], out, vocab_size=1000, input_sentence_size=20_000, num_threads=2,
                                pad_id=3, user_defined_symbols=["<cls>", "<sep>", "<mask>"])
    return build_tokenizer(model)


def test_whole_word_masking_with_sentencepiece(corpus, sp_with_specials, tmp_path):
    tok = sp_with_specials
    sp = tok.sp
    cls, sep = sp.piece_to_id("<cls>"), sp.piece_to_id("<sep>")
    assert tok.mask is not None and tok.pad == 3 and len({cls, sep, tok.mask, tok.pad}) == 4
    summary = run_preprocess(PreprocessConfig(input=[str(corpus)], output_prefix=str(tmp_path / "w"),
                                              tokenizer_model=tok.model_path, split_sentences=True, workers=1))
    ds = IndexedDataset(summary.outputs["text"])
    assert summary.outputs["text"].endswith("_sentence") and len(ds) > 2 * ds.num_documents

    def partial_words(whole_word):
        cfg = BertDatasetConfig(max_seq_length=128, vocab_size=tok.vocab_size, cls_id=cls, sep_id=sep,
                                mask_id=tok.mask, pad_id=tok.pad, seed=3,
                                is_word_start=(lambda i: sp.id_to_piece(i).startswith("▁")) if whole_word else None)
        bert = BertDataset(ds, (0, ds.num_documents), None, cfg)
        partial = chosen = cands = 0
        for i in range(min(len(bert), 300)):
            s = bert[i]
            orig, sel = original(s), s["labels"] != -100
            n = int(s["padding_mask"].sum())
            normal = (orig != cls) & (orig != sep) & (np.arange(128) < n)
            # a word: a normal token whose piece starts with "▁" (or follows a special), then its continuations
            starts = normal & np.r_[True, ~normal[:-1]] | normal & np.array(
                [sp.id_to_piece(int(t)).startswith("▁") for t in orig])
            word = np.cumsum(starts)
            for w in np.unique(word[sel]):
                member = normal & (word == w)
                partial += int(not sel[member].all())
            chosen += sel.sum()
            cands += normal.sum()
        return partial, chosen / cands

    partial, rate = partial_words(True)
    assert partial == 0 and 0.13 < rate < 0.16  # round() per sequence lets short ones exceed 15%
    partial, rate = partial_words(False)
    assert partial > 0 and rate == pytest.approx(0.15, abs=0.01)  # the check above can fail


def test_single_segment_mode_and_pickled_word_start_config(tmp_path):
    ds, vocab = sentence_corpus(tmp_path / "s")
    starts = lambda i: i % 2 == 0  # noqa: E731 - a lambda does not pickle; the config keeps its table only
    cfg = config(vocab, sentence_task="none", is_word_start=starts)
    bert = pickle.loads(pickle.dumps(BertDataset(ds, (0, ds.num_documents), None, cfg)))
    np.testing.assert_array_equal(bert.config.word_starts, np.arange(vocab) % 2 == 0)
    for i in range(len(bert)):
        s = bert[i]
        n = int(s["padding_mask"].sum())
        tok = original(s)[:n]
        assert tok[0] == CLS and tok[-1] == SEP and (tok[1:-1] >= FIRST_TOKEN).all()
        assert not s["types"].any() and s["is_random"] == 0
        if not s["truncated"]:
            assert (np.diff(tok[1:-1]) == 1).all()
    # one-sentence documents count too: one epoch covers every sentence once
    assert sorted(k for a, b, _ in bert.samples for k in range(a, b)) == list(range(len(ds)))
    with pytest.raises(ValueError, match="word_starts"):
        config(vocab, word_starts=np.ones(3, dtype=bool))


def test_a_corpus_without_sentences_raises_its_own_error_class():
    """Callers tell "not sentence-split" from other bad input by class (mg train adds how to make one)."""
    from mg_data import NotSentenceSplitError

    with pytest.raises(NotSentenceSplitError, match="sentence-split"):
        build_bert_samples(np.array([30, 40]), np.array([0, 1, 2]), 0, max_num_tokens=61, short_seq_prob=0.1,
                           min_sentences=2, num_samples=4, seed=0, shuffle=True)
