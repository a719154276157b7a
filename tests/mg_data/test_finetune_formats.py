"""Classification and seq2seq data: samples token by token, label mapping, bad lines, length policies,
preprocessing round trips, and seq2seq samples shaped exactly as T5 span-corruption samples."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mg_data import (
    BadExampleError,
    BadLineError,
    ClassificationDataset,
    ClassificationDatasetConfig,
    IndexedClassificationExamples,
    IndexedExampleFields,
    PreprocessConfig,
    Seq2SeqDataset,
    Seq2SeqDatasetConfig,
    T5Dataset,
    T5DatasetConfig,
    build_classification_datasets,
    build_seq2seq_datasets,
    run_preprocess,
    tokenize_classification_jsonl,
    tokenize_seq2seq_jsonl,
)
from mg_data.classification import truncate_longest_first
from mg_data.indexed import IndexedDataset
from mg_data.tokenizers import ByteTokenizer, build_tokenizer

BYTES = ByteTokenizer()
EOD, BOS, PAD = BYTES.eod, BYTES.bos, BYTES.pad  # 256, 257, 258
BERT = {"cls_id": BOS, "sep_id": EOD, "pad_id": PAD}
GPT = {"separator_ids": [EOD], "end_ids": [EOD], "pad_id": PAD}


def write_lines(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return path


def ids(text):
    return list(text.encode())


def examples(n, seed=0, labels=("neg", "pos", "mid")):
    """``n`` classification lines of varied lengths, a pair on two in three, labels in a mixed order."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        line = {"text": f"t{i} " + "a" * int(rng.integers(0, 30)), "label": labels[int(rng.integers(0, len(labels)))]}
        if i % 3:
            line["text_pair"] = f"p{i} " + "b" * int(rng.integers(0, 30))
        out.append(line)
    return out


def pairs(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"input": f"in{i} " + "x" * int(rng.integers(0, 40)), "target": f"out{i} " + "y" * int(rng.integers(0, 20))}
            for i in range(n)]


def preprocess(path, prefix, fmt, **kw):
    kw.setdefault("tokenizer_model", None)
    if kw["tokenizer_model"] is None:
        kw.setdefault("tokenizer_type", "byte")
    return run_preprocess(PreprocessConfig(input=[str(path)], output_prefix=str(prefix), format=fmt, **kw))


def same_samples(a, b):
    if a is None or b is None:
        assert a is b
        return
    assert len(a) == len(b)
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) and x[k].dtype == y[k].dtype for k in x)


# ---- samples token by token ---------------------------------------------------------------------

def test_bert_pair_with_token_types(tmp_path):
    path = write_lines(tmp_path / "c.jsonl", [{"text": "ab", "text_pair": "xyz", "label": "pos"},
                                              {"text": "hello", "label": "neg"}])
    data = tokenize_classification_jsonl([path], BYTES)
    ds = ClassificationDataset(data, (0, 2), None, ClassificationDatasetConfig(max_seq_length=10, shuffle=False, **BERT))
    assert ds.label_names == ["neg", "pos"] and ds.num_labels == 2
    s = ds[0]
    assert sorted(s) == ["label", "padding_mask", "text", "types"]
    assert s["text"].tolist() == [BOS, *ids("ab"), EOD, *ids("xyz"), EOD, PAD, PAD]
    assert s["types"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0]
    assert s["padding_mask"].tolist() == [1] * 8 + [0, 0]
    assert s["label"].shape == () and int(s["label"]) == 1
    assert all(s[k].dtype == np.int64 for k in s)
    s = ds[1]
    assert s["text"].tolist() == [BOS, *ids("hello"), EOD, PAD, PAD, PAD]
    assert s["types"].tolist() == [0] * 10 and s["padding_mask"].tolist() == [1] * 7 + [0] * 3 and s["label"] == 0


def test_gpt_label_read_at_the_last_real_token(tmp_path):
    path = write_lines(tmp_path / "c.jsonl", [{"text": "ab", "text_pair": "xyz", "label": 1}, {"text": "hi", "label": 0}])
    ds = ClassificationDataset(tokenize_classification_jsonl([path], BYTES), (0, 2), None,
                               ClassificationDatasetConfig(max_seq_length=10, shuffle=False, **GPT))
    assert ds.label_names is None and ds.num_labels == 2
    s = ds[0]
    assert sorted(s) == ["attention_mask", "label", "tokens"]
    assert s["tokens"].tolist() == [*ids("ab"), EOD, *ids("xyz"), EOD, PAD, PAD, PAD]
    assert s["attention_mask"].tolist() == [1] * 7 + [0] * 3 and s["label"] == 1
    # the head's rule (mg_models.heads.last_token_hidden): the rightmost position whose mask is 1
    last = int(np.argmax(np.arange(10) * s["attention_mask"]))
    assert last == 6 and s["tokens"][last] == EOD
    s = ds[1]
    assert s["tokens"].tolist() == [*ids("hi"), EOD] + [PAD] * 7 and s["attention_mask"].sum() == 3
    with pytest.raises(BadExampleError, match=rf"^{path}:1: has a text_pair but separator_ids is not set"):
        ClassificationDataset(tokenize_classification_jsonl([path], BYTES), (0, 2), None,
                              ClassificationDatasetConfig(max_seq_length=10, pad_id=PAD))


def test_seq2seq_decoder_start_labels_and_eos(tmp_path):
    path = write_lines(tmp_path / "s.jsonl", [{"input": "abc", "target": "de"}])
    cfg = Seq2SeqDatasetConfig(encoder_seq_length=6, decoder_seq_length=5, eos_id=EOD, pad_id=PAD, decoder_start_id=BOS)
    s = Seq2SeqDataset(tokenize_seq2seq_jsonl([path], BYTES), (0, 1), None, cfg)[0]
    assert s["text_enc"].tolist() == [*ids("abc"), EOD, PAD, PAD]
    assert s["enc_mask"].tolist() == [1, 1, 1, 1, 0, 0]
    assert s["text_dec"].tolist() == [BOS, *ids("de"), PAD, PAD]
    assert s["labels"].tolist() == [*ids("de"), EOD, -100, -100]
    assert s["loss_mask"].tolist() == [1, 1, 1, 0, 0] and s["loss_mask"].dtype == np.float32
    assert s["dec_mask"].tolist() == [1, 1, 1, 0, 0] and s["dec_mask"].dtype == np.int64
    cfg = Seq2SeqDatasetConfig(encoder_seq_length=6, decoder_seq_length=5, eos_id=EOD, pad_id=PAD)
    assert Seq2SeqDataset(tokenize_seq2seq_jsonl([path], BYTES), (0, 1), None, cfg)[0]["text_dec"][0] == PAD


# ---- labels ---------------------------------------------------------------------------------------

def test_label_mapping_is_sorted_or_given_and_recorded(tmp_path):
    lines = [{"text": "a", "label": "pos"}, {"text": "b", "label": "neg"}, {"text": "c", "label": "mid"},
             {"text": "d", "label": "pos"}]
    path = write_lines(tmp_path / "c.jsonl", lines)
    data = tokenize_classification_jsonl([path], BYTES)
    assert data.label_names == ["mid", "neg", "pos"] and data.labels.tolist() == [2, 1, 0, 2]
    given = tokenize_classification_jsonl([path], BYTES, labels=["pos", "neg", "mid"])
    assert given.label_names == ["pos", "neg", "mid"] and given.labels.tolist() == [0, 1, 2, 0]
    # preprocessing records the mapping and counts; partitions that meet labels in other orders agree
    for workers in (1, 2):
        s = preprocess(path, tmp_path / f"w{workers}", "classification", partition_bytes=30, workers=workers)
        assert s.partitions >= 3 and s.labels["label_names"] == ["mid", "neg", "pos"]
        assert s.labels["label_counts"] == [1, 1, 2] and s.labels["num_labels"] == 3
        assert json.loads((tmp_path / f"w{workers}_labels.json").read_text())["label_names"] == ["mid", "neg", "pos"]
        assert IndexedClassificationExamples(tmp_path / f"w{workers}").labels.tolist() == [2, 1, 0, 2]
    s = preprocess(path, tmp_path / "g", "classification", labels=["pos", "neg", "mid"])
    assert IndexedClassificationExamples(tmp_path / "g").labels.tolist() == [0, 1, 2, 0]
    assert s.labels["label_names"] == ["pos", "neg", "mid"] and "text_pair" not in s.outputs


def test_splits_share_one_mapping(tmp_path):
    train = write_lines(tmp_path / "train.jsonl", [{"text": "a", "label": "b"}, {"text": "b", "label": "c"}])
    valid = write_lines(tmp_path / "valid.jsonl", [{"text": "c", "label": "a"}, {"text": "d", "label": "c"}])
    cfg = ClassificationDatasetConfig(max_seq_length=8, shuffle=False, **BERT)
    tr, va, te = build_classification_datasets(cfg, blend_per_split=[[str(train)], [str(valid)], None], tokenizer=BYTES)
    assert te is None and tr.label_names == va.label_names == ["a", "b", "c"]
    assert [int(tr[i]["label"]) for i in range(2)] == [1, 2] and [int(va[i]["label"]) for i in range(2)] == [0, 2]
    # a preprocessed training set and a JSONL validation file
    preprocess(train, tmp_path / "tr", "classification")
    tr, va, _ = build_classification_datasets(cfg, blend_per_split=[[str(tmp_path / "tr")], [str(valid)], None],
                                              tokenizer=BYTES)
    assert tr.label_names == va.label_names == ["a", "b", "c"] and [int(tr[i]["label"]) for i in range(2)] == [1, 2]
    with pytest.raises(BadExampleError, match=rf"^{valid}:1: label 'a' is not one of the labels \['b', 'c'\]$"):
        build_classification_datasets(ClassificationDatasetConfig(max_seq_length=8, labels=["b", "c"], **BERT),
                                      blend_per_split=[[str(train)], [str(valid)], None], tokenizer=BYTES)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        build_classification_datasets(cfg, [str(train)])


def test_integer_labels_are_used_as_is(tmp_path):
    path = write_lines(tmp_path / "c.jsonl", [{"text": "a", "label": 2}, {"text": "b", "label": 0}])
    data = tokenize_classification_jsonl([path], BYTES, num_labels=4)
    assert data.label_names is None and data.num_labels == 4 and data.labels.tolist() == [2, 0]
    ds = ClassificationDataset(data, (0, 2), None,
                               ClassificationDatasetConfig(max_seq_length=8, num_labels=4, shuffle=False, **BERT))
    assert ds.num_labels == 4 and [int(ds[i]["label"]) for i in range(2)] == [2, 0]
    with pytest.raises(BadExampleError, match=rf"^{path}:1: label 2 is outside \[0, num_labels = 2\)$"):
        tokenize_classification_jsonl([path], BYTES, num_labels=2)
    with pytest.raises(BadLineError, match=rf"^{path}:1: label 2 is outside \[0, num_labels = 2\)"):
        preprocess(path, tmp_path / "o", "classification", num_labels=2)
    s = preprocess(path, tmp_path / "o", "classification")
    assert s.labels["label_names"] is None and s.labels["num_labels"] == 3 and s.labels["label_counts"] == [1, 0, 1]


def test_mixed_kinds_and_too_many_labels_name_the_line(tmp_path):
    mixed = write_lines(tmp_path / "m.jsonl", [{"text": "a", "label": "x"}] * 5 + [{"text": "b", "label": 1}])
    for run in (lambda: tokenize_classification_jsonl([mixed], BYTES),
                lambda: preprocess(mixed, tmp_path / "m", "classification", partition_bytes=40)):
        with pytest.raises(BadLineError, match=rf"^{mixed}:6: label is an integer but earlier labels are strings"):
            run()
    many = write_lines(tmp_path / "n.jsonl", [{"text": "a", "label": k} for k in "zzyzxw"])
    for run in (lambda: tokenize_classification_jsonl([many], BYTES, num_labels=2),
                lambda: preprocess(many, tmp_path / "n", "classification", num_labels=2, partition_bytes=40)):
        with pytest.raises(BadExampleError, match=rf"^{many}:5: label 'x' is distinct label number 3 but num_labels = 2"):
            run()
    with pytest.raises(ValueError, match="holds 2 labels"):
        preprocess(write_lines(tmp_path / "f.jsonl", [{"text": "a", "label": k} for k in "ab"]), tmp_path / "f",
                   "classification", num_labels=3)


BAD_LINES = {
    "missing text": ({"label": "a"}, "missing key 'text'"),
    "missing label": ({"text": "t"}, "missing key 'label'"),
    "empty text": ({"text": "  ", "label": "a"}, "key 'text' is empty"),
    "text not a string": ({"text": 3, "label": "a"}, "key 'text' holds int, expected a string"),
    "pair not a string": ({"text": "t", "text_pair": ["x"], "label": "a"}, "key 'text_pair' holds list"),
    "empty pair": ({"text": "t", "text_pair": "", "label": "a"}, "key 'text_pair' is empty"),
    "label float": ({"text": "t", "label": 1.5}, "key 'label' holds float, expected a string or an integer"),
    "label bool": ({"text": "t", "label": True}, "key 'label' holds bool"),
    "label not in set": ({"text": "t", "label": "maybe"}, "label 'maybe' is not one of the labels ['neg', 'pos', 'mid']"),
    "malformed": ("{oops", "malformed JSON"),
    "not an object": ([1], "expected a JSON object, got list"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_classification_line_names_file_and_line(case, tmp_path):
    line, reason = BAD_LINES[case]
    good = examples(20)
    path = write_lines(tmp_path / "bad.jsonl", good[:12] + [""] + [line] + good[12:])  # line 14
    labels = ["neg", "pos", "mid"]
    for run in (lambda: tokenize_classification_jsonl([path], BYTES, labels=labels),
                lambda: preprocess(path, tmp_path / "o", "classification", labels=labels, partition_bytes=200)):
        with pytest.raises(BadLineError) as e:
            run()
        assert (e.value.path, e.value.line) == (str(path), 14) and str(e.value).startswith(f"{path}:14: ")
        assert reason in str(e.value) and "\n" not in str(e.value)
    s = preprocess(path, tmp_path / "s", "classification", labels=labels, skip_bad_lines=True)
    assert s.bad_lines == 1 and s.documents == 20 and s.bad_line_examples[0].startswith(f"{path}:14: ")


@pytest.mark.parametrize("line, reason", [({"input": "x"}, "missing key 'target'"),
                                          ({"input": "", "target": "y"}, "key 'input' is empty"),
                                          ({"input": "x", "target": None}, "key 'target' holds NoneType")])
def test_bad_seq2seq_line_names_file_and_line(line, reason, tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", pairs(5) + [line] + pairs(3))
    for run in (lambda: tokenize_seq2seq_jsonl([path], BYTES), lambda: preprocess(path, tmp_path / "o", "seq2seq")):
        with pytest.raises(BadLineError, match=rf"^{path}:6: {reason}"):
            run()


# ---- lengths --------------------------------------------------------------------------------------

def test_longest_first_removes_from_the_longer_one_token_at_a_time():
    for n_a in range(12):
        for n_b in range(12):
            for budget in range(24):
                a, b = n_a, n_b
                while a + b > budget:  # the reference: one token from the longer, the second on a tie
                    if a > b:
                        a -= 1
                    else:
                        b -= 1
                assert truncate_longest_first(n_a, n_b, budget) == (a, b), (n_a, n_b, budget)


def test_classification_on_long(tmp_path):
    lines = [{"text": "abcdefgh", "text_pair": "xyz", "label": "a"}, {"text": "ok", "label": "b"},
             {"text": "abcdefghij", "label": "a"}]
    path = write_lines(tmp_path / "c.jsonl", lines)
    data = tokenize_classification_jsonl([path], BYTES)

    def cfg(policy, **style):
        return ClassificationDatasetConfig(max_seq_length=8, on_long=policy, shuffle=False, **(style or BERT))

    with pytest.raises(BadExampleError, match=rf"^{path}:1: example has 14 tokens \(8 text, 3 text_pair, 3 special\), "
                                              r"more than max_seq_length = 8 \(2 such in the train split\)"):
        ClassificationDataset(data, (0, 3), None, cfg("error"))
    drop = ClassificationDataset(data, (0, 3), None, cfg("drop"))
    assert len(drop) == 1 and drop.num_dropped == 2 and drop[0]["text"].tolist() == [BOS, *ids("ok"), EOD] + [PAD] * 4
    cut = ClassificationDataset(data, (0, 3), None, cfg("truncate"))
    assert cut.num_truncated == 2 and len(cut) == 3
    assert cut[0]["text"].tolist() == [BOS, *ids("abc"), EOD, *ids("xy"), EOD]  # 5 of 11 kept: 3 + 2
    assert cut[2]["text"].tolist() == [BOS, *ids("abcdef"), EOD]
    gpt = ClassificationDataset(data, (0, 3), None, cfg("truncate", **GPT))
    assert gpt[0]["tokens"].tolist() == [*ids("abc"), EOD, *ids("xyz"), EOD]  # 6 of 11 kept: 3 + 3
    assert gpt[2]["tokens"].tolist() == [*ids("abcdefg"), EOD] and gpt[2]["attention_mask"].sum() == 8
    # preprocessed examples are stored whole and cut the same way at load time
    preprocess(path, tmp_path / "p", "classification")
    same_samples(ClassificationDataset(IndexedClassificationExamples(tmp_path / "p"), (0, 3), None, cfg("truncate")), cut)
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'p'}: example 0: example has 14 tokens"):
        ClassificationDataset(IndexedClassificationExamples(tmp_path / "p"), (0, 3), None, cfg("error"))


def test_seq2seq_on_long(tmp_path):
    path = write_lines(tmp_path / "s.jsonl", [{"input": "abcdefgh", "target": "ok"}, {"input": "hi", "target": "yo"},
                                              {"input": "hi", "target": "abcdef"}])
    data = tokenize_seq2seq_jsonl([path], BYTES)

    def cfg(policy):
        return Seq2SeqDatasetConfig(encoder_seq_length=5, decoder_seq_length=4, eos_id=EOD, pad_id=PAD, on_long=policy,
                                    shuffle=False)

    with pytest.raises(BadExampleError, match=rf"^{path}:1: example has 8 input and 2 target tokens; with EOS at most "
                                              r"encoder_seq_length - 1 = 4 and decoder_seq_length - 1 = 3 fit"):
        Seq2SeqDataset(data, (0, 3), None, cfg("error"))
    drop = Seq2SeqDataset(data, (0, 3), None, cfg("drop"))
    assert len(drop) == 1 and drop.num_dropped == 2 and drop[0]["labels"].tolist() == [*ids("yo"), EOD, -100]
    cut = Seq2SeqDataset(data, (0, 3), None, cfg("truncate"))
    assert cut.num_truncated == 2
    assert cut[0]["text_enc"].tolist() == [*ids("abcd"), EOD] and cut[0]["enc_mask"].tolist() == [1] * 5
    assert cut[2]["labels"].tolist() == [*ids("abc"), EOD] and cut[2]["text_dec"].tolist() == [PAD, *ids("abc")]


# ---- preprocessing round trips ----------------------------------------------------------------------

def test_classification_preprocess_round_trip_equals_in_memory(sp_model, tmp_path):
    path = write_lines(tmp_path / "c.jsonl", examples(150))
    tok = build_tokenizer(sp_model)
    files = []
    for workers in (1, 2):
        s = preprocess(path, tmp_path / f"w{workers}", "classification", tokenizer_model=sp_model, workers=workers,
                       partition_bytes=1500)
        assert s.partitions > 4 and s.documents == 150 and s.pairs == 100
        assert s.outputs == {k: str(tmp_path / f"w{workers}_{k}_document") for k in ("text", "text_pair", "label")}
        files.append([open(f"{p}.{ext}", "rb").read() for p in s.outputs.values() for ext in ("bin", "idx")]
                     + [(tmp_path / f"w{workers}_labels.json").read_bytes()])
    assert files[0] == files[1]
    ref = tokenize_classification_jsonl([path], tok)
    stored = IndexedClassificationExamples(tmp_path / "w1")
    assert stored.datasets["text"].dtype == np.uint16 and IndexedDataset(tmp_path / "w1_label_document").dtype == np.int32
    assert stored.label_names == ref.label_names == ["mid", "neg", "pos"] and np.array_equal(stored.labels, ref.labels)
    for i in range(150):
        for f in ("text", "text_pair"):
            assert stored.get(f, i).tolist() == ref.get(f, i).tolist()
    assert s.tokens["text"] == int(ref.lengths["text"].sum()) and s.tokens["text_pair"] == int(ref.lengths["text_pair"].sum())
    # datasets read the prefix as they read the JSONL; blends mix prefixes by weight
    cfg = ClassificationDatasetConfig(max_seq_length=24, on_long="truncate", split="9,1", seed=4, **BERT)
    from_prefix = build_classification_datasets(cfg, [str(tmp_path / "w1")], (300, None, None))
    from_jsonl = build_classification_datasets(cfg, [str(path)], (300, None, None), tokenizer=tok)
    for a, b in zip(from_prefix, from_jsonl):
        same_samples(a, b)
    assert len(from_prefix[0]) == 135 * 3 and len(from_prefix[1]) == 15 and from_prefix[2] is None
    train, _, _ = build_classification_datasets(cfg, ["0.5", str(tmp_path / "w1"), "0.5",
                                                      str(tmp_path / "w2_text_document")], (50, 10, None))
    assert len(train) == 50 and train.label_names == ["mid", "neg", "pos"] and train.num_labels == 3
    assert {int(train[i]["dataset_id"]) for i in range(50)} == {0, 1}
    with pytest.raises(ValueError, match="blends need preprocessed data"):
        build_classification_datasets(cfg, ["0.5", str(path), "0.5", str(tmp_path / "w1")], (5, 5, None))


def test_seq2seq_preprocess_round_trip_equals_in_memory(sp_model, tmp_path):
    path = write_lines(tmp_path / "s.jsonl", pairs(120))
    tok = build_tokenizer(sp_model)
    s = preprocess(path, tmp_path / "p", "seq2seq", tokenizer_model=sp_model, workers=2, partition_bytes=1000)
    assert s.partitions > 4 and s.documents == 120
    assert s.outputs == {"input": str(tmp_path / "p_input_document"), "target": str(tmp_path / "p_target_document")}
    stored = IndexedExampleFields(tmp_path / "p", ("input", "target"))
    assert len(stored.datasets["input"]) == len(stored.datasets["target"]) == 120
    cfg = Seq2SeqDatasetConfig(encoder_seq_length=24, decoder_seq_length=12, eos_id=tok.eod, pad_id=0, split="1",
                               on_long="truncate")
    (a, _, _), (b, _, _) = (build_seq2seq_datasets(cfg, [str(tmp_path / "p")]),
                            build_seq2seq_datasets(cfg, [str(path)], tokenizer=tok))
    same_samples(a, b)
    ref = tokenize_seq2seq_jsonl([path], tok)
    assert s.tokens["input"] == int(ref.lengths["input"].sum()) and s.tokens["target"] == int(ref.lengths["target"].sum())


def test_seq2seq_samples_are_shaped_as_t5_samples(corpus, sp_model, tmp_path):
    tok = build_tokenizer(sp_model)
    s = run_preprocess(PreprocessConfig(input=[str(corpus)], output_prefix=str(tmp_path / "t5"), tokenizer_model=sp_model,
                                        partition_bytes=1 << 20))
    t5cfg = T5DatasetConfig(encoder_seq_length=64, decoder_seq_length=32, sentinel_ids=list(range(900, 1000)),
                            eos_id=tok.eod, pad_id=0, decoder_start_id=1, split="1")
    t5 = T5Dataset(IndexedDataset(s.outputs["text"]), (0, 50), 4, t5cfg)
    texts = [json.loads(x)["text"] for x in corpus.read_text().splitlines()[:20]]
    path = write_lines(tmp_path / "s.jsonl", [{"input": t[:200], "target": t[200:260] or "x"} for t in texts])
    ours = Seq2SeqDataset(tokenize_seq2seq_jsonl([path], tok), (0, 20), None,
                          Seq2SeqDatasetConfig(encoder_seq_length=64, decoder_seq_length=32, eos_id=tok.eod, pad_id=0,
                                               decoder_start_id=1, on_long="truncate"))
    for i in range(4):
        a, b = t5[i], ours[i]
        assert list(a) == list(b)
        assert [(k, a[k].dtype, a[k].shape) for k in a] == [(k, b[k].dtype, b[k].shape) for k in b]
        for x in (a, b):  # the conventions both follow
            assert x["text_dec"][0] == 1 and np.array_equal(x["text_dec"][1:][x["dec_mask"][1:] == 1],
                                                            x["labels"][:-1][x["dec_mask"][1:] == 1])
            assert (x["labels"][x["dec_mask"] == 0] == -100).all() and x["labels"][x["dec_mask"] == 1][-1] == tok.eod
            assert np.array_equal(x["loss_mask"], x["dec_mask"].astype(np.float32))


def test_config_errors():
    with pytest.raises(ValueError, match="cls_id and sep_id go together"):
        ClassificationDatasetConfig(max_seq_length=8, cls_id=1)
    with pytest.raises(ValueError, match="separator_ids and end_ids are for GPT style"):
        ClassificationDatasetConfig(max_seq_length=8, separator_ids=[1], **BERT)
    with pytest.raises(ValueError, match="max_seq_length must be >= 5"):
        ClassificationDatasetConfig(max_seq_length=4, **BERT)
    with pytest.raises(ValueError, match="num_labels is 3 but labels names 2"):
        ClassificationDatasetConfig(max_seq_length=8, labels=["a", "b"], num_labels=3)
    with pytest.raises(ValueError, match="on_long must be one of"):
        Seq2SeqDatasetConfig(encoder_seq_length=8, decoder_seq_length=8, eos_id=1, pad_id=0, on_long="cut")
    with pytest.raises(ValueError, match="do not apply to format=seq2seq"):
        PreprocessConfig(input=["x"], output_prefix="o", tokenizer_model=None, tokenizer_type="byte", format="seq2seq",
                         seq_length=8)
    with pytest.raises(ValueError, match="apply to format=classification only"):
        PreprocessConfig(input=["x"], output_prefix="o", tokenizer_model=None, tokenizer_type="byte", labels=["a", "b"])
