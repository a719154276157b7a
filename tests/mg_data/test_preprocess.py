"""Preprocessing: exact tokens against direct SentencePiece calls, determinism, bad lines, resume."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import sentencepiece as spm
import zstandard

from mg_data.indexed import IndexedDataset
from mg_data.jsonl import BadLineError
from mg_data.preprocess import PreprocessConfig, run_preprocess


def reference_tokens(jsonl, model, key="text", eod=True):
    """Tokens per document computed directly: json.loads per line and SentencePiece encode."""
    sp = spm.SentencePieceProcessor(model_file=model)
    out = []
    for line in open(jsonl, encoding="utf-8"):
        ids = sp.encode(json.loads(line)[key])
        if ids:
            out.append(ids + ([sp.eos_id()] if eod else []))
    return out


def read_all(prefix):
    ds = IndexedDataset(prefix)
    ds.verify()
    return [ds.get_document(d).tolist() for d in range(ds.num_documents)]


def files_of(prefix):
    return open(f"{prefix}.bin", "rb").read(), open(f"{prefix}.idx", "rb").read()


def test_matches_reference_and_is_identical_for_any_worker_count(corpus, sp_model, tmp_path):
    outs = {}
    for workers, method in ((1, None), (3, "fork"), (2, "spawn")):
        cfg = PreprocessConfig(input=[str(corpus)], output_prefix=str(tmp_path / f"w{workers}"),
                               tokenizer_model=sp_model, workers=workers, partition_bytes=60_000, append_eod=True,
                               start_method=method)
        seen = []
        s = run_preprocess(cfg, progress=seen.append)
        outs[workers] = files_of(s.outputs["text"])
        assert s.partitions > 5 and seen[-1].partitions_done == s.partitions == seen[-1].partitions_total
        assert seen[-1].mb_per_s > 0 and seen[-1].docs_per_s > 0 and seen[-1].bytes == corpus.stat().st_size
    assert outs[1] == outs[2] == outs[3]
    ref = reference_tokens(corpus, sp_model)
    got = read_all(tmp_path / "w1_text_document")
    assert got == ref
    assert IndexedDataset(tmp_path / "w1_text_document").dtype == np.uint16
    assert not list(tmp_path.glob("*.parts-*"))  # scratch partials removed


def test_compressed_inputs_and_multiple_keys(corpus, sp_model, tmp_path):
    raw = corpus.read_bytes()
    gz, zst = tmp_path / "c.jsonl.gz", tmp_path / "c.jsonl.zst"
    gz.write_bytes(gzip.compress(raw))
    zst.write_bytes(zstandard.ZstdCompressor().compress(raw))
    outs = []
    for src, workers in ((corpus, 1), (gz, 1), (zst, 2)):
        s = run_preprocess(PreprocessConfig(input=[str(src)], output_prefix=str(tmp_path / src.name),
                                            tokenizer_model=sp_model, json_keys=["text", "name"],
                                            workers=workers, partition_bytes=100_000))
        assert set(s.outputs) == {"text", "name"}
        outs.append((files_of(s.outputs["text"]), files_of(s.outputs["name"])))
    assert outs[0] == outs[1] == outs[2]
    assert read_all(tmp_path / "stdlib.jsonl_name_document") == reference_tokens(corpus, sp_model, "name", False)


def test_glob_and_file_order(corpus, sp_model, tmp_path):
    lines = corpus.read_text().splitlines(keepends=True)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("".join(lines[:10]))
    (tmp_path / "in" / "b.jsonl").write_text("".join(lines[10:]))
    run_preprocess(PreprocessConfig(input=[str(tmp_path / "in" / "*.jsonl")], output_prefix=str(tmp_path / "g"),
                                    tokenizer_model=sp_model, append_eod=True))
    assert read_all(tmp_path / "g_text_document") == reference_tokens(corpus, sp_model)


def _bad_corpus(tmp_path):
    lines = [json.dumps({"text": "good one"}).encode(), b'{"text": "broken', json.dumps({"title": "x"}).encode(),
             json.dumps({"text": 5}).encode(), b'{"text": "bad \xff utf8"}', b"   ", json.dumps({"text": ""}).encode(),
             json.dumps({"text": "good two"}).encode(), b"[1, 2]"]
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_line_names_file_and_line(tmp_path, sp_model, workers):
    path = _bad_corpus(tmp_path)
    cfg = PreprocessConfig(input=[str(path)], output_prefix=str(tmp_path / "o"), tokenizer_model=sp_model,
                           workers=workers, partition_bytes=40)
    with pytest.raises(BadLineError, match=r"bad\.jsonl:2: malformed JSON") as e:
        run_preprocess(cfg)
    assert e.value.line == 2
    for n, reason in [(3, "missing key 'text'"), (4, "key .text. holds int, expected a string"), (5, "invalid UTF-8"),
                      (9, "expected a JSON object")]:
        lines = path.read_bytes().split(b"\n")
        keep = [ln for i, ln in enumerate(lines, 1) if i >= n or i in (1, 6, 7, 8)]
        p2 = tmp_path / f"bad{n}.jsonl"
        p2.write_bytes(b"\n".join(keep))
        line = keep.index(lines[n - 1]) + 1
        with pytest.raises(BadLineError, match=rf"bad{n}\.jsonl:{line}: {reason}"):
            run_preprocess(PreprocessConfig(input=[str(p2)], output_prefix=str(tmp_path / f"o{n}"),
                                            tokenizer_model=sp_model, workers=1, partition_bytes=40))


def test_skip_bad_lines_counts_them(tmp_path, sp_model):
    path = _bad_corpus(tmp_path)
    s = run_preprocess(PreprocessConfig(input=[str(path)], output_prefix=str(tmp_path / "o"),
                                        tokenizer_model=sp_model, skip_bad_lines=True, append_eod=True,
                                        partition_bytes=50))
    assert s.bad_lines == 5 and s.blank_lines == 1 and s.empty_documents["text"] == 1
    assert [x.split(": ")[0].rsplit(":", 1)[1] for x in s.bad_line_examples] == ["2", "3", "4", "5", "9"]
    sp = spm.SentencePieceProcessor(model_file=sp_model)
    assert read_all(tmp_path / "o_text_document") == [sp.encode("good one") + [2], sp.encode("good two") + [2]]


def test_resume_skips_finished_partitions_and_gives_identical_output(corpus, sp_model, tmp_path):
    ref = run_preprocess(PreprocessConfig(input=[str(corpus)], output_prefix=str(tmp_path / "ref"),
                                          tokenizer_model=sp_model, partition_bytes=60_000))
    cfg = PreprocessConfig(input=[str(corpus)], output_prefix=str(tmp_path / "r"), tokenizer_model=sp_model,
                           partition_bytes=60_000, workers=1)

    def crash_after_three(info):
        if info.partitions_done == 3:
            raise KeyboardInterrupt("simulated crash")

    with pytest.raises(KeyboardInterrupt):
        run_preprocess(cfg, progress=crash_after_three)
    assert not (tmp_path / "r_text_document.idx").exists()
    (parts,) = tmp_path.glob("r.parts-*")
    assert len(list(parts.glob("*.done"))) == 3
    # a partial whose data was lost (machine crash before the page cache reached the disk) is redone
    lost = sorted(parts.glob("part-0000001_*.bin"))[0]
    lost.write_bytes(lost.read_bytes()[:-2])
    s = run_preprocess(cfg)
    assert s.partitions_resumed == 2 and s.partitions == ref.partitions
    assert files_of(tmp_path / "r_text_document") == files_of(tmp_path / "ref_text_document")
    assert s.tokens == ref.tokens and s.documents == ref.documents
    assert not parts.exists()


def test_changed_options_never_reuse_partials(corpus, sp_model, tmp_path):
    base = dict(input=[str(corpus)], output_prefix=str(tmp_path / "r"), tokenizer_model=sp_model,
                partition_bytes=60_000, keep_partitions=True)
    run_preprocess(PreprocessConfig(**base))
    s = run_preprocess(PreprocessConfig(**base, append_eod=True))
    assert s.partitions_resumed == 0 and len(list(tmp_path.glob("r.parts-*"))) == 2
    assert read_all(tmp_path / "r_text_document") == reference_tokens(corpus, sp_model)
    s = run_preprocess(PreprocessConfig(**base, append_eod=True))
    assert s.partitions_resumed == s.partitions


def test_sentence_split_output(tmp_path, sp_model):
    path = tmp_path / "s.jsonl"
    docs = ["First sentence here. Second one follows! Third?", "", "Only one", "Dr. Smith went home. Then slept."]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    s = run_preprocess(PreprocessConfig(input=[str(path)], output_prefix=str(tmp_path / "s"),
                                        tokenizer_model=sp_model, split_sentences=True, append_eod=True))
    assert s.outputs["text"].endswith("s_text_sentence") and s.empty_documents["text"] == 1
    ds = IndexedDataset(s.outputs["text"])
    sp = spm.SentencePieceProcessor(model_file=sp_model)
    expect = [["First sentence here.", "Second one follows!", "Third?"], ["Only one"],
              ["Dr. Smith went home.", "Then slept."]]
    assert ds.num_documents == 3 and len(ds) == 6
    seqs = [x.tolist() for x in ds[0:6]]
    flat = [sp.encode(t) for d in expect for t in d]
    for i in (2, 3, 5):  # last sentence of each document carries the EOD
        flat[i] = flat[i] + [2]
    assert seqs == flat
    assert ds.document_indices.tolist() == [0, 3, 4, 6]


def test_config_validation():
    with pytest.raises(ValueError, match="workers"):
        PreprocessConfig(input=["x"], output_prefix="o", tokenizer_model="m", workers=0)
    with pytest.raises(ValueError, match="json_keys"):
        PreprocessConfig(input=["x"], output_prefix="o", tokenizer_model="m", json_keys=["a", "a"])
    with pytest.raises(ValueError, match="tokenizer_model is required"):
        PreprocessConfig(input=["x"], output_prefix="o", tokenizer_model=None)
    with pytest.raises(FileNotFoundError, match="nothere.jsonl: input file not found"):
        run_preprocess(PreprocessConfig(input=["nothere.jsonl"], output_prefix="o", tokenizer_model="m"))


def test_tokenizer_problems_fail_before_work(tmp_path, corpus):
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"nope")
    with pytest.raises(ValueError, match="junk.model: not a loadable SentencePiece model"):
        run_preprocess(PreprocessConfig(input=[str(corpus)], output_prefix=str(tmp_path / "o"),
                                        tokenizer_model=str(junk), workers=2))
    s = run_preprocess(PreprocessConfig(input=[str(corpus)], output_prefix=str(tmp_path / "n"), tokenizer_model=None,
                                        tokenizer_type="ByteTokenizer", append_eod=True))
    ds = IndexedDataset(s.outputs["text"])
    first = json.loads(corpus.read_text().split("\n")[0])["text"]
    assert ds[0].tolist() == list(first.encode()) + [256] and ds.dtype == np.uint16
