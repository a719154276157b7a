"""Sequence-to-sequence fine-tuning data (T5): ``{"input": str, "target": str}`` JSONL lines.

Samples have the keys, dtypes and padding of ``T5Dataset``'s span-corruption samples, so the same T5
forward and loss consume both. Preprocessing (``PreprocessConfig(format="seq2seq")``) writes
``PREFIX_input_document`` and ``PREFIX_target_document``, one sequence per example (no EOS; it is
added when a sample is read).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mg_data.finetune import (
    BadExampleError,
    ExampleDataset,
    ExampleDatasetConfig,
    ExampleFields,
    IndexedExampleFields,
    build_example_datasets,
    field_prefix,
    load_examples,
    read_jsonl_examples,
    string_field,
)
from mg_data.jsonl import BadLineError, load_json_line
from mg_data.masking import IGNORE_INDEX
from mg_data.tokenizers import Tokenizer

FIELDS = ("input", "target")


def parse_seq2seq(raw: bytes | str, path: str, line: int | None, error: type[BadLineError] = BadExampleError
                  ) -> tuple[str, str]:
    """``(input, target)`` of one JSONL line.

    Raises:
        error: invalid JSON, or a missing, non-string or empty ``input`` or ``target``.
    """
    obj = load_json_line(raw, path, line, error)
    return tuple(string_field(obj, k, path, line, error=error) for k in FIELDS)  # type: ignore[return-value]


def tokenize_seq2seq_jsonl(inputs: Sequence[str | os.PathLike[str]], tokenizer: Tokenizer) -> ExampleFields:
    """Read and tokenise seq2seq lines in memory (small data; preprocess large data).

    Returns:
        ``ExampleFields`` with fields ``input`` and ``target`` and each example's ``(file, line)``.

    Raises:
        FileNotFoundError: an input is missing. BadExampleError: a bad line (``FILE:LINE: reason``).
    """
    return read_jsonl_examples(inputs, tokenizer, FIELDS, lambda raw, path, n, _: parse_seq2seq(raw, path, n))[0]


def load_seq2seq_examples(path: str | os.PathLike[str], tokenizer: Tokenizer | None = None) -> ExampleFields:
    """The examples of a JSONL file (read in memory, needs ``tokenizer``) or of a preprocessed prefix.

    Raises:
        ValueError: a JSONL file without a tokenizer; and as the readers.
    """
    return load_examples(path, tokenizer, "seq2seq", lambda p, tok: tokenize_seq2seq_jsonl([p], tok),
                         lambda p: IndexedExampleFields(p, FIELDS))


@dataclass(kw_only=True)
class Seq2SeqDatasetConfig(ExampleDatasetConfig):
    """How seq2seq samples are built (T5 sample layout), truncated (an input over E - 1 or a target over
    D - 1 tokens; ``truncate`` keeps the first ones, then EOS), split and shuffled."""

    encoder_seq_length: int
    """Encoder positions E: input ids + EOS, padded."""
    decoder_seq_length: int
    """Decoder positions D: target ids + EOS (labels), padded."""
    eos_id: int
    """End-of-sequence id closing input and target."""
    pad_id: int
    """Id written into padding positions (labels are -100 there)."""
    decoder_start_id: int | None = None
    """First decoder input id; None uses ``pad_id`` as T5 does."""

    def __post_init__(self) -> None:
        for name in ("encoder_seq_length", "decoder_seq_length"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name} must be >= 2 (one token and EOS), got {getattr(self, name)}")
        for name in ("eos_id", "pad_id"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be a token id (>= 0), got {getattr(self, name)}")
        super().__post_init__()


class Seq2SeqDataset(ExampleDataset):
    """Seq2seq samples, one per example of a range, in a seeded per-epoch order.

    ``ds[i]`` has exactly the keys, dtypes and shapes of ``T5Dataset`` samples (E =
    ``encoder_seq_length``, D = ``decoder_seq_length``):

    * ``text_enc`` int64 (E,): input ids, EOS, then ``pad_id``;
    * ``text_dec`` int64 (D,): ``decoder_start_id`` then the labels shifted right, then ``pad_id``;
    * ``labels`` int64 (D,): target ids then EOS, -100 on padding;
    * ``loss_mask`` float32 (D,): 1 on labels; ``enc_mask`` / ``dec_mask`` int64 (E,) / (D,): 1 on
      real tokens, 0 on padding.

    Args and raises as ``ExampleDataset``; ``truncate`` keeps the first E - 1 input and D - 1 target tokens.
    """

    def _excess(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        cfg = self.config
        return (np.maximum(self.examples.lengths["input"][ids] + 1 - cfg.encoder_seq_length, 0),
                np.maximum(self.examples.lengths["target"][ids] + 1 - cfg.decoder_seq_length, 0))

    def excess(self, ids: np.ndarray) -> np.ndarray:
        enc, dec = self._excess(ids)
        return enc + dec

    def too_long_reason(self, i: int) -> str:
        cfg, lengths = self.config, self.examples.lengths
        return (f"example has {lengths['input'][i]} input and {lengths['target'][i]} target tokens; with EOS at most "
                f"encoder_seq_length - 1 = {cfg.encoder_seq_length - 1} and decoder_seq_length - 1 = "
                f"{cfg.decoder_seq_length - 1} fit")

    def sample(self, i: int) -> dict[str, np.ndarray]:
        cfg = self.config
        e_len, d_len = cfg.encoder_seq_length, cfg.decoder_seq_length
        enc = np.append(self.examples.get("input", i)[:e_len - 1], cfg.eos_id)
        targets = np.append(self.examples.get("target", i)[:d_len - 1], cfg.eos_id)
        start = cfg.pad_id if cfg.decoder_start_id is None else cfg.decoder_start_id
        dec_mask = _padded(np.ones(len(targets)), d_len, 0)
        return {"text_enc": _padded(enc, e_len, cfg.pad_id),
                "text_dec": _padded(np.append(start, targets[:-1]), d_len, cfg.pad_id),
                "labels": _padded(targets, d_len, IGNORE_INDEX), "loss_mask": dec_mask.astype(np.float32),
                "enc_mask": _padded(np.ones(len(enc)), e_len, 0), "dec_mask": dec_mask}


def _padded(values: np.ndarray, length: int, fill: int) -> np.ndarray:
    """``values`` then ``fill`` up to ``length``, int64."""
    out = np.full(length, fill, dtype=np.int64)
    out[:len(values)] = values
    return out


def build_seq2seq_datasets(config: Seq2SeqDatasetConfig, blend: Sequence[str | float] | None = None,
                           num_samples: Sequence[int | None] = (None, None, None), *,
                           blend_per_split: Sequence[Sequence[str | float] | None] | None = None,
                           tokenizer: Tokenizer | None = None) -> list[Any]:
    """Train/valid/test seq2seq datasets, from prefixes or JSONL files as ``build_classification_datasets``.

    Returns:
        Three datasets (``Seq2SeqDataset``, ``BlendedDataset`` or None).

    Raises:
        ValueError: as ``build_example_datasets`` and ``Seq2SeqDataset``.
    """
    return build_example_datasets(
        config, lambda p: load_seq2seq_examples(p, tokenizer),
        lambda ex, rng, n, name: Seq2SeqDataset(ex, rng, n, config, name),
        lambda p: field_prefix(p, "input", FIELDS), blend, num_samples, blend_per_split)
