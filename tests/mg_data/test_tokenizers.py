"""Tokenizer interface: SentencePiece, Hugging Face tokenizer.json, GPT-2 BPE files, null/byte; type inference."""

from __future__ import annotations

import json

import pytest
import sentencepiece as spm
import tokenizers as hft

from mg_data.tokenizers import (
    ByteTokenizer,
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    TokenizerTrainConfig,
    build_tokenizer,
    infer_tokenizer_type,
    run_tokenizer_train,
)

TEXT = "def main(argv):\n    return sorted(argv)  # ok"


def test_sentencepiece_matches_library_and_eod_is_eos(sp_model):
    tok = build_tokenizer(sp_model)
    ref = spm.SentencePieceProcessor(model_file=sp_model)
    assert isinstance(tok, SentencePieceTokenizer)
    assert tok.vocab_size == ref.get_piece_size() == 1000
    assert tok.eod == ref.eos_id() == 2 and tok.bos == 1 and tok.pad is None
    assert tok.encode(TEXT) == ref.encode(TEXT)
    assert tok.encode_batch([TEXT, "x = 1"]) == [ref.encode(TEXT), ref.encode("x = 1")]
    assert tok.decode(tok.encode("x = 1")) == ref.decode(ref.encode("x = 1"))
    assert build_tokenizer(sp_model, "SentencePieceTokenizer").encode(TEXT) == ref.encode(TEXT)


def _train_hf(corpus_path, out_dir):
    texts = [json.loads(line)["text"] for line in open(corpus_path)][:50]
    tok = hft.Tokenizer(hft.models.BPE(unk_token=None))
    tok.pre_tokenizer = hft.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = hft.decoders.ByteLevel()
    trainer = hft.trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=hft.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    tok.model.save(str(out_dir))  # vocab.json + merges.txt: the GPT-2 file pair
    return tok


def test_hf_and_gpt2_files(corpus, tmp_path):
    ref = _train_hf(corpus, tmp_path)
    hf = build_tokenizer(tmp_path / "tokenizer.json")
    assert isinstance(hf, HuggingFaceTokenizer)
    assert hf.encode(TEXT) == ref.encode(TEXT, add_special_tokens=False).ids
    assert hf.eod == ref.token_to_id("<|endoftext|>")
    assert hf.decode(hf.encode(TEXT)) == TEXT
    assert isinstance(build_tokenizer(tmp_path), HuggingFaceTokenizer)  # a directory with tokenizer.json
    gpt2 = build_tokenizer(tmp_path / "vocab.json")
    assert isinstance(gpt2, GPT2BPETokenizer)
    assert gpt2.encode(TEXT) == hf.encode(TEXT) and gpt2.eod == hf.eod
    assert gpt2.encode_batch([TEXT, "a"]) == [hf.encode(TEXT), hf.encode("a")]
    assert build_tokenizer(tmp_path / "vocab.json", "GPT2BPETokenizer").encode("a b") == hf.encode("a b")


def test_null_and_byte_tokenizers():
    null = build_tokenizer(None, "NullTokenizer", vocab_size=100)
    assert isinstance(null, NullTokenizer) and null.eod == 100 and null.vocab_size == 101
    assert null.encode("3 4  5") == [3, 4, 5] and null.decode([3, 4]) == "3 4"
    byte = build_tokenizer(None, "byte")
    assert isinstance(byte, ByteTokenizer)
    assert byte.encode("é") == list("é".encode()) and byte.decode(byte.encode("héllo")) == "héllo"


def test_errors_name_the_problem(tmp_path, sp_model):
    with pytest.raises(ValueError, match="unknown tokenizer type 'Foo'"):
        build_tokenizer(sp_model, "Foo")
    with pytest.raises(ValueError, match="not found"):
        build_tokenizer(tmp_path / "missing.model")
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="junk.model: not a loadable SentencePiece model"):
        build_tokenizer(junk)
    other = tmp_path / "x.bin"
    other.write_bytes(b"\x00\x01")
    with pytest.raises(ValueError, match="cannot tell the tokenizer type"):
        infer_tokenizer_type(other)
    with pytest.raises(ValueError, match="merges file not found"):
        (tmp_path / "v").mkdir()
        (tmp_path / "v" / "vocab.json").write_text("{}")
        build_tokenizer(tmp_path / "v" / "vocab.json")


def test_train_config_round_trip(corpus, tmp_path):
    cfg = TokenizerTrainConfig(input=[str(corpus)], model_prefix=str(tmp_path / "u"), vocab_size=800,
                               model_type="bpe", input_sentence_size=5000, user_defined_symbols=["<mask>"])
    tok = build_tokenizer(run_tokenizer_train(cfg))
    assert tok.vocab_size == 800 and tok.eod == 2 and tok.mask is not None
    assert tok.decode(tok.encode("import os")) == "import os"
    with pytest.raises(ValueError, match="model_type"):
        TokenizerTrainConfig(input=["x"], model_prefix="m", vocab_size=100, model_type="wordpiece")
    with pytest.raises(FileNotFoundError, match="input file not found"):
        run_tokenizer_train(TokenizerTrainConfig(input=["nothere.jsonl"], model_prefix="m", vocab_size=100))


def test_preprocess_with_hf_tokenizer_json(corpus, tmp_path):
    from mg_data.indexed import IndexedDataset
    from mg_data.preprocess import PreprocessConfig, run_preprocess

    ref = _train_hf(corpus, tmp_path)
    s = run_preprocess(PreprocessConfig(input=[str(corpus)], output_prefix=str(tmp_path / "hf"),
                                        tokenizer_model=str(tmp_path / "tokenizer.json"), append_eod=True,
                                        tokenizer_type="HuggingFaceTokenizer"))
    ds = IndexedDataset(s.outputs["text"])
    texts = [json.loads(line)["text"] for line in open(corpus)]
    eod = ref.token_to_id("<|endoftext|>")
    for d in (0, 5, len(texts) - 1):
        assert ds.get_document(d).tolist() == ref.encode(texts[d], add_special_tokens=False).ids + [eod]


def test_exact_whitespace_round_trips_every_corpus_document(corpus, sp_model):
    tok = build_tokenizer(sp_model)
    texts = [json.loads(line)["text"] for line in open(corpus)]
    assert tok.exact_whitespace and len(texts) > 100
    assert [tok.decode(ids) for ids in tok.encode_batch(texts)] == texts
    assert all(tok.decode(tok.encode(t)) == t for t in texts[::7])


EDGE_CASES = [
    "", "\n", "\n\n\n", "\t", "\tx\t\ty\t", "a  b   c    d", "   leading", "trailing   ", " \n \n",
    "if x:\n\tpass\n\n\n    return  1\n", "line one\r\nline two\r\n", "\r", "naïve café — ½ ﬁ Ω ℃",
    "中文, 日本語, 한국어 😀\n", "e\u0301 vs \u00e9", "\u00a0nbsp\u3000ideographic", "x\x00\x0by",
    "\u2581", "a\u2581b \u2581\u2581 c\u2581", "  \u2581\n\t",
]


@pytest.mark.parametrize("text", EDGE_CASES)
def test_exact_whitespace_round_trips_edge_cases(sp_model, text):
    tok = build_tokenizer(sp_model)
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode_batch([text, "x"])[0]) == text


def test_newlines_and_indentation_are_few_pieces(sp_model):
    tok = build_tokenizer(sp_model)
    pieces = [tok.sp.id_to_piece(i) for i in tok.encode("def f(x):\n        return x\n")]
    assert sum(p.count("\n") for p in pieces) == 2
    assert len(tok.encode("\n")) == 1 and len(tok.encode("    ")) == 1 and len(tok.encode("        ")) <= 2
    assert len(tok.encode("\n\n")) <= 2 and len(tok.encode("\t")) <= 1
    # a continuation decodes on its own (mg generate prints prompt + decode(new tokens))
    ids = tok.encode(TEXT)
    assert all(tok.decode(ids[:k]) + tok.decode(ids[k:]) == TEXT for k in range(len(ids)))


def test_line_by_line_tokenizer_loads_and_works_as_before(corpus, tmp_path):
    model = run_tokenizer_train(TokenizerTrainConfig(input=[str(corpus)], model_prefix=str(tmp_path / "old"),
                                                     vocab_size=800, input_sentence_size=5000,
                                                     exact_whitespace=False))
    tok, ref = build_tokenizer(model), spm.SentencePieceProcessor(model_file=model)
    assert isinstance(tok, SentencePieceTokenizer) and not tok.exact_whitespace
    for text in (TEXT, "a\u2581b", "x\r\n\ty  z"):
        assert tok.encode(text) == ref.encode(text)
        assert tok.decode(tok.encode(text)) == ref.decode(ref.encode(text))
    assert tok.encode_batch([TEXT, "a\u2581b"]) == [ref.encode(TEXT), ref.encode("a\u2581b")]
    assert tok.decode(tok.encode(TEXT)) == "def main(argv): return sorted(argv) # ok"  # whitespace collapsed


def test_training_pieces_keep_every_character(tmp_path):
    from mg_data.tokenizers import _training_chunks

    docs = ["a\n" * 50, "x" * 30 + "\n\n" + "é" * 20, "", "  \n", "no newline"]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    pieces = list(_training_chunks([str(path)], ["text"], 16))
    assert all(len(p.encode()) <= 16 for p in pieces)
    assert "".join(pieces) == "".join(docs)
    assert pieces[:2] == ["a\n" * 8, "a\n" * 8]  # cut after newlines
