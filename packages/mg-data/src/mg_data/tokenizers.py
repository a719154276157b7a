"""Tokenizers behind one small interface, selected from a file or a Megatron tokenizer name.

``build_tokenizer(path, type=None)`` infers the kind from the file: a SentencePiece ``.model``,
a Hugging Face ``tokenizer.json`` (needs the ``hf`` extra), a GPT-2 ``vocab.json`` with a
``merges.txt`` beside it (``hf`` extra). ``ByteTokenizer`` and ``NullTokenizer`` need no file.
``train_sentencepiece`` trains a SentencePiece model on JSONL input; by default the model keeps
text exactly (newlines, tabs, runs of spaces, no Unicode normalisation), so that
``decode(encode(text)) == text``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from itertools import chain, islice
from pathlib import Path
from typing import Any

import sentencepiece as spm

from mg_data.jsonl import iter_json_texts


class Tokenizer:
    """Interface: vocabulary size, special ids (None when absent), encode/decode, batch encode."""

    name: str = "tokenizer"
    vocab_size: int
    eod: int | None = None
    bos: int | None = None
    pad: int | None = None
    mask: int | None = None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text; implementations use the library's batched path when it has one."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"


def _none_if_negative(i: int) -> int | None:
    return None if i < 0 else int(i)


# SentencePiece writes a space as this symbol, so a literal one in the text would come back as a space.
_SP_SPACE = "\u2581"
# Decodes to itself only where the model keeps whitespace as written and encodings of pieces concatenate.
_EXACT_PROBE = (" a\n", "\tb  c\n\n")


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model file. ``eod`` is the model's ``eos_id()``.

    ``exact_whitespace`` is True for models that keep whitespace as written (``train_sentencepiece``'s
    default). With byte fallback their ``decode(encode(text)) == text`` for any text, a literal
    ``\u2581`` (the symbol SentencePiece writes spaces as) included: it is encoded as its UTF-8
    byte pieces. Otherwise (and for models trained on normalised lines) ``encode`` is the
    SentencePiece library's.

    Args:
        model_path: the ``.model`` file.
        num_threads: threads SentencePiece uses inside ``encode_batch``.
    """

    name = "SentencePieceTokenizer"

    def __init__(self, model_path: str | os.PathLike[str], num_threads: int = 1) -> None:
        self.model_path = os.fspath(model_path)
        self.num_threads = num_threads
        try:
            self.sp = spm.SentencePieceProcessor(model_file=self.model_path)
        except (OSError, RuntimeError) as e:
            raise ValueError(f"{self.model_path}: not a loadable SentencePiece model ({e})") from None
        self.vocab_size = int(self.sp.get_piece_size())
        self.eod = _none_if_negative(self.sp.eos_id())
        self.bos = _none_if_negative(self.sp.bos_id())
        self.pad = _none_if_negative(self.sp.pad_id())
        mask = self.sp.piece_to_id("<mask>")
        self.mask = None if mask == self.sp.unk_id() else int(mask)
        a, b = _EXACT_PROBE
        self.exact_whitespace = self.sp.decode(self.sp.encode(a) + self.sp.encode(b)) == a + b
        space_bytes = [self.sp.piece_to_id(f"<0x{x:02X}>") for x in _SP_SPACE.encode("utf-8")]
        exact_bytes = self.exact_whitespace and all(self.sp.is_byte(i) for i in space_bytes)
        self._space_symbol = space_bytes if exact_bytes else None

    def _encode_space_symbol(self, text: str) -> list[int]:
        # the text around each literal symbol is encoded alone; exact models' encodings concatenate
        assert self._space_symbol is not None
        out: list[int] = []
        for k, part in enumerate(text.split(_SP_SPACE)):
            if k:
                out += self._space_symbol
            if part:
                out += self.sp.encode(part)
        return out

    def encode(self, text: str) -> list[int]:
        if self._space_symbol is not None and _SP_SPACE in text:
            return self._encode_space_symbol(text)
        return self.sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        out = self.sp.encode(list(texts), num_threads=self.num_threads)
        if self._space_symbol is not None:
            for k, text in enumerate(texts):
                if _SP_SPACE in text:
                    out[k] = self._encode_space_symbol(text)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.decode([int(i) for i in ids])


_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]", "<|im_end|>")


def _require_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ImportError("Hugging Face tokenizers are not installed; run `pip install mg-data[hf]`") from None
    return tokenizers


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` (or a directory holding one), via the ``tokenizers`` library.

    ``eod`` is the first of ``<|endoftext|>``, ``</s>``, ``<|end_of_text|>``, ``<eos>`` ... found in
    the vocabulary, or ``eod_token`` when given. Requires the ``hf`` extra.
    """

    name = "HuggingFaceTokenizer"

    def __init__(self, path: str | os.PathLike[str], eod_token: str | None = None) -> None:
        tokenizers = _require_tokenizers()
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        self.path = os.fspath(p)
        try:
            self.tok = tokenizers.Tokenizer.from_file(self.path)
        except Exception as e:  # the Rust side raises a bare Exception subclass
            raise ValueError(f"{self.path}: not a loadable Hugging Face tokenizer.json ({e})") from None
        self._init_specials(eod_token)

    def _init_specials(self, eod_token: str | None) -> None:
        self.vocab_size = int(self.tok.get_vocab_size(with_added_tokens=True))
        if eod_token is not None:
            if self.tok.token_to_id(eod_token) is None:
                raise ValueError(f"eod_token {eod_token!r} is not in the vocabulary")
            cands: tuple[str, ...] = (eod_token,)
        else:
            cands = _EOD_CANDIDATES
        self.eod = next((self.tok.token_to_id(t) for t in cands if self.tok.token_to_id(t) is not None), None)
        self.bos = next((self.tok.token_to_id(t) for t in ("<s>", "<|begin_of_text|>", "<bos>")
                         if self.tok.token_to_id(t) is not None), None)
        self.pad = next((self.tok.token_to_id(t) for t in ("<pad>", "[PAD]", "<|pad|>")
                         if self.tok.token_to_id(t) is not None), None)
        self.mask = next((self.tok.token_to_id(t) for t in ("<mask>", "[MASK]")
                          if self.tok.token_to_id(t) is not None), None)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


class GPT2BPETokenizer(HuggingFaceTokenizer):
    """GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt`` (``hf`` extra); eod ``<|endoftext|>``."""

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str | os.PathLike[str], merges_file: str | os.PathLike[str] | None = None
                 ) -> None:
        tokenizers = _require_tokenizers()
        vocab_file = os.fspath(vocab_file)
        merges = os.fspath(merges_file) if merges_file else os.path.join(os.path.dirname(vocab_file),
                                                                           "merges.txt")
        if not os.path.isfile(merges):
            raise ValueError(f"{merges}: merges file not found; pass merges_file= for {vocab_file}")
        self.path = vocab_file
        bpe = tokenizers.models.BPE.from_file(vocab_file, merges)
        tok = tokenizers.Tokenizer(bpe)
        tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tokenizers.decoders.ByteLevel()
        self.tok = tok
        self._init_specials("<|endoftext|>" if tok.token_to_id("<|endoftext|>") is not None else None)


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, ``eod`` 256, ``bos`` 257, ``pad`` 258; vocabulary 259 (tests, debugging)."""

    name = "ByteTokenizer"

    def __init__(self) -> None:
        self.vocab_size, self.eod, self.bos, self.pad = 259, 256, 257, 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class NullTokenizer(Tokenizer):
    """Megatron's null tokenizer: text is space-separated integer ids; ``eod`` is ``vocab_size``."""

    name = "NullTokenizer"

    def __init__(self, vocab_size: int) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive for NullTokenizer, got {vocab_size}")
        self.vocab_size = vocab_size + 1
        self.eod = vocab_size

    def encode(self, text: str) -> list[int]:
        try:
            return [int(x) for x in text.split()]
        except ValueError:
            raise ValueError(f"NullTokenizer input must be space-separated integers, got {text[:40]!r}"
                             ) from None

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


_TYPE_ALIASES = {
    "sentencepiecetokenizer": "sentencepiece", "gptsentencepiecetokenizer": "sentencepiece",
    "llama2tokenizer": "sentencepiece", "sentencepiece": "sentencepiece", "sp": "sentencepiece",
    "huggingfacetokenizer": "hf", "hf": "hf", "huggingface": "hf",
    "gpt2bpetokenizer": "gpt2", "gpt2": "gpt2",
    "nulltokenizer": "null", "null": "null", "bytetokenizer": "byte", "byte": "byte",
}


@dataclass(frozen=True)
class TokenizerSpec:
    """Picklable recipe for a tokenizer, so worker processes can rebuild it."""

    path: str | None
    type: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self) -> Tokenizer:
        """The tokenizer this spec describes (see ``build_tokenizer``)."""
        return build_tokenizer(self.path, self.type, **self.kwargs)


def infer_tokenizer_type(path: str | os.PathLike[str]) -> str:
    """Kind of tokenizer file: ``sentencepiece``, ``hf`` or ``gpt2``.

    Raises:
        ValueError: the file is missing or of no recognised kind.
    """
    p = Path(path)
    if p.is_dir():
        if (p / "tokenizer.json").is_file():
            return "hf"
        if (p / "tokenizer.model").is_file():
            return "sentencepiece"
        raise ValueError(f"{p}: directory holds neither tokenizer.json nor tokenizer.model")
    if not p.is_file():
        raise ValueError(f"{p}: tokenizer file not found")
    if p.suffix == ".model":
        return "sentencepiece"
    if p.suffix == ".json":
        try:
            with open(p, encoding="utf-8") as f:
                head = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"{p}: unreadable JSON ({e})") from None
        if isinstance(head, dict) and "model" in head:
            return "hf"
        if isinstance(head, dict):
            return "gpt2"
    with open(p, "rb") as f:
        magic = f.read(2)
    if magic[:1] == b"\n":  # serialized ModelProto starts with field 1 (pieces), wire type 2
        return "sentencepiece"
    raise ValueError(f"{p}: cannot tell the tokenizer type; pass --tokenizer-type")


def build_tokenizer(path: str | os.PathLike[str] | None, type: str | None = None, **kwargs: Any
                    ) -> Tokenizer:
    """Build a tokenizer from a file, inferring its type unless ``type`` is given.

    Args:
        path: ``.model`` (SentencePiece), ``tokenizer.json`` or its directory (Hugging Face),
            ``vocab.json`` (GPT-2 BPE, ``merges.txt`` beside it or ``merges_file=``); None for
            ``NullTokenizer``/``ByteTokenizer``.
        type: Megatron's names (``SentencePieceTokenizer``, ``HuggingFaceTokenizer``,
            ``GPT2BPETokenizer``, ``NullTokenizer``) or ``sentencepiece``/``hf``/``gpt2``/``null``/``byte``.
        kwargs: passed to the tokenizer class (``num_threads``, ``vocab_size``, ``merges_file``,
            ``eod_token``).

    Raises:
        ValueError: unknown type, missing file, or a file that is not of the type.
    """
    if type is None:
        if path is None:
            raise ValueError("a tokenizer path is needed unless --tokenizer-type is NullTokenizer/ByteTokenizer")
        kind = infer_tokenizer_type(path)
    else:
        kind = _TYPE_ALIASES.get(type.lower().replace("-", "").replace("_", ""))
        if kind is None:
            raise ValueError(f"unknown tokenizer type {type!r}; use one of SentencePieceTokenizer, "
                             "HuggingFaceTokenizer, GPT2BPETokenizer, NullTokenizer, ByteTokenizer")
    if kind == "null":
        return NullTokenizer(kwargs.get("vocab_size", 0))
    if kind == "byte":
        return ByteTokenizer()
    if path is None:
        raise ValueError(f"tokenizer type {type} needs a tokenizer model path")
    if kind == "sentencepiece":
        p = Path(path)
        return SentencePieceTokenizer(p / "tokenizer.model" if p.is_dir() else p, **kwargs)
    if kind == "hf":
        return HuggingFaceTokenizer(path, **kwargs)
    return GPT2BPETokenizer(path, **kwargs)


def _training_lines(inputs: Sequence[str], json_keys: Sequence[str], max_line_bytes: int) -> Iterator[str]:
    # SentencePiece drops "sentences" longer than max_sentence_length, so documents are fed line by line.
    for text in iter_json_texts(inputs, json_keys):
        for line in text.split("\n"):
            line = line.strip()
            if line and len(line.encode("utf-8")) <= max_line_bytes:
                yield line


def _training_chunks(inputs: Sequence[str], json_keys: Sequence[str], max_bytes: int) -> Iterator[str]:
    """Documents as written, cut after newlines into pieces of at most ``max_bytes`` UTF-8 bytes.

    SentencePiece takes each piece whole (newlines included) and drops longer ones; a single line
    longer than ``max_bytes`` is cut into slices of ``max_bytes // 4`` characters.
    """
    for text in iter_json_texts(inputs, json_keys):
        lines = text.split("\n")
        piece: list[str] = []
        size = 0
        for k, line in enumerate(lines):
            if k < len(lines) - 1:
                line += "\n"
            n = len(line.encode("utf-8"))
            if n > max_bytes:
                step = max(1, max_bytes // 4)
                slices = [line[i:i + step] for i in range(0, len(line), step)]
            else:
                slices = [line] if line else []
            for part in slices:
                n = len(part.encode("utf-8"))
                if piece and size + n > max_bytes:
                    yield "".join(piece)
                    piece, size = [], 0
                piece.append(part)
                size += n
        if piece:
            yield "".join(piece)


def _lines_per_piece(head: Sequence[str]) -> float:
    """Mean number of lines in the first training pieces (1 when there are none)."""
    lines = sum(p.count("\n") + (not p.endswith("\n")) for p in head)
    return lines / len(head) if head else 1.0


def train_sentencepiece(inputs: Sequence[str | os.PathLike[str]], model_prefix: str | os.PathLike[str], *,
                        vocab_size: int, model_type: str = "bpe", json_keys: Sequence[str] = ("text",),
                        byte_fallback: bool = True, character_coverage: float = 0.9995,
                        input_sentence_size: int = 1_000_000, num_threads: int = 1,
                        pad_id: int = -1, user_defined_symbols: Sequence[str] = (),
                        max_sentence_length: int = 4192, seed_sentencepiece_size: int = 1_000_000,
                        extra_options: dict[str, Any] | None = None, exact_whitespace: bool = True) -> str:
    """Train a SentencePiece model on the ``json_keys`` texts of JSONL files (.gz/.zst allowed).

    With ``exact_whitespace`` (the default) the model keeps text as written: documents are fed
    whole, cut after newlines into pieces of at most ``max_sentence_length`` bytes; newlines,
    tabs, leading, trailing and repeated spaces are kept (whitespace-only pieces allowed), there
    is no Unicode normalisation and no dummy leading space, so with ``byte_fallback``
    ``SentencePieceTokenizer``'s ``decode(encode(text)) == text`` for every text. Without it, the
    former training: stripped lines of at most ``max_sentence_length`` bytes, NFKC-normalised,
    repeated spaces collapsed, newlines dropped.

    About ``input_sentence_size`` lines are sampled (whole pieces of them with ``exact_whitespace``)
    and malformed JSONL lines are left out. Ids: unk 0, bos 1, eos 2 (the end-of-document id
    preprocessing appends), pad ``pad_id``.

    Returns:
        The path of the written ``MODEL_PREFIX.model`` (a ``.vocab`` is written beside it).

    Raises:
        ValueError: bad argument or input files without any text (from SentencePiece's message).
    """
    if model_type not in ("bpe", "unigram", "char", "word"):
        raise ValueError(f"model_type must be bpe, unigram, char or word, got {model_type!r}")
    if vocab_size < 8:
        raise ValueError(f"vocab_size must be at least 8, got {vocab_size}")
    prefix = os.fspath(model_prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    files = [os.fspath(p) for p in inputs]
    options: dict[str, Any] = dict(
        model_prefix=prefix, vocab_size=vocab_size, model_type=model_type, byte_fallback=byte_fallback,
        character_coverage=character_coverage, input_sentence_size=input_sentence_size,
        shuffle_input_sentence=True, num_threads=num_threads, unk_id=0, bos_id=1, eos_id=2, pad_id=pad_id,
        max_sentence_length=max_sentence_length, seed_sentencepiece_size=seed_sentencepiece_size,
        minloglevel=2,
    )
    if exact_whitespace:
        pieces = _training_chunks(files, json_keys, max_sentence_length)
        head = list(islice(pieces, 1000))
        sentences: Iterator[str] = chain(head, pieces)
        # the sample stays about input_sentence_size lines, as in line-by-line training
        # (SentencePiece accepts no sample of 1..100 sentences: such a request takes 101)
        options["input_sentence_size"] = max(101, round(input_sentence_size / _lines_per_piece(head)))
        options.update(normalization_rule_name="identity", remove_extra_whitespaces=False,
                       add_dummy_prefix=False, allow_whitespace_only_pieces=True, split_by_whitespace=True)
    else:
        sentences = _training_lines(files, json_keys, max_sentence_length)
    if user_defined_symbols:
        options["user_defined_symbols"] = list(user_defined_symbols)
    options.update(extra_options or {})
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=sentences, **options)
    except RuntimeError as e:
        raise ValueError(f"SentencePiece training on {files[:3]} failed: {e}") from None
    return prefix + ".model"


@dataclass(kw_only=True)
class TokenizerTrainConfig:
    """Options of ``mg tokenizer train`` (SentencePiece on JSONL input)."""

    input: Sequence[str]
    """JSONL files or globs (.gz/.zst allowed)."""
    model_prefix: str
    """Writes ``MODEL_PREFIX.model`` and ``MODEL_PREFIX.vocab``."""
    vocab_size: int
    """Number of pieces, special tokens included."""
    model_type: str = "bpe"
    """``bpe``, ``unigram``, ``char`` or ``word``."""
    json_keys: Sequence[str] = ("text",)
    """Keys whose text is used."""
    byte_fallback: bool = True
    """Spell unknown characters as UTF-8 byte pieces instead of ``<unk>``."""
    character_coverage: float = 0.9995
    """Share of characters covered by the vocabulary."""
    input_sentence_size: int = 1_000_000
    """About this many lines are sampled for training (bounds time and memory)."""
    num_threads: int = 1
    """Training threads."""
    pad_id: int = -1
    """Id of a padding piece; -1 for none."""
    user_defined_symbols: Sequence[str] = ()
    """Pieces always kept whole (e.g. ``<mask>``)."""
    exact_whitespace: bool = True
    """Keep newlines, tabs and runs of spaces so decoding is exact (False: train on stripped lines)."""

    def __post_init__(self) -> None:
        if isinstance(self.input, str):
            self.input = [self.input]
        if not self.input:
            raise ValueError("input is empty; pass at least one JSONL file or glob")
        if self.vocab_size < 8:
            raise ValueError(f"vocab_size must be at least 8, got {self.vocab_size}")
        if self.model_type not in ("bpe", "unigram", "char", "word"):
            raise ValueError(f"model_type must be bpe, unigram, char or word, got {self.model_type!r}")
        if not 0 < self.character_coverage <= 1:
            raise ValueError(f"character_coverage must be in (0, 1], got {self.character_coverage}")
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")


def run_tokenizer_train(config: TokenizerTrainConfig) -> str:
    """Train the SentencePiece model ``config`` describes; returns the ``.model`` path.

    Raises:
        FileNotFoundError: an input is missing. ValueError: SentencePiece rejected the options/input.
    """
    from mg_data.jsonl import expand_inputs

    kwargs = asdict(config)
    files = expand_inputs(kwargs.pop("input"))
    return train_sentencepiece(files, kwargs.pop("model_prefix"), **kwargs)
