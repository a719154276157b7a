"""Sequence-classification data (BERT and GPT classification heads).

A JSONL line is ``{"text": str, "text_pair": str (optional), "label": str or int}``. String labels
become ids in a deterministic order: the order of an explicit ``labels`` list, else sorted. Integer
labels are ids as they are (``0 <= label < num_labels``). The label names are recorded (the dataset's
``label_names``, preprocessing's ``PREFIX_labels.json``) so a fine-tuned checkpoint can store them.

Preprocessing (``PreprocessConfig(format="classification")``) writes ``PREFIX_text_document``,
``PREFIX_text_pair_document`` (only when some line has a pair; empty sequences for those without),
``PREFIX_label_document`` (int32, one single-token sequence per example) and ``PREFIX_labels.json``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mg_data.blended import BlendedDataset
from mg_data.finetune import (
    BadExampleError,
    ExampleDataset,
    ExampleDatasetConfig,
    ExampleFields,
    IndexedExampleFields,
    blend_paths,
    build_example_datasets,
    field_prefix,
    load_examples,
    read_jsonl_examples,
    string_field,
)
from mg_data.indexed import IndexedDataset, IndexedDatasetBuilder
from mg_data.jsonl import BadLineError, load_json_line
from mg_data.tokenizers import Tokenizer

FIELDS = ("text", "text_pair")
LABEL_FIELD = "label"
LABELS_SUFFIX = "_labels.json"


def check_label_options(labels: Sequence[str] | None, num_labels: int | None, owner: str = "") -> list[str] | None:
    """``labels`` as a list after checking it and ``num_labels`` (``owner`` prefixes the field names).

    Raises:
        ValueError: labels empty, repeated or not strings; num_labels below 2 or not ``len(labels)``.
    """
    if labels is not None:
        labels = list(labels)
        if len(labels) < 2 or len(set(labels)) != len(labels) or not all(isinstance(x, str) and x for x in labels):
            raise ValueError(f"{owner}labels must be at least two distinct non-empty strings, got {labels}")
    if num_labels is not None:
        if num_labels < 2:
            raise ValueError(f"{owner}num_labels must be >= 2, got {num_labels} (1 would be regression, which needs "
                             "float labels)")
        if labels is not None and num_labels != len(labels):
            raise ValueError(f"{owner}num_labels is {num_labels} but {owner}labels names {len(labels)}; drop one of them")
    return labels


class LabelEncoder:
    """Label values of consecutive lines to ids.

    With ``labels``, a string is its index there and an integer must be below ``len(labels)``.
    Without, integers are kept (below ``num_labels`` when given) and strings get local ids in order
    of first appearance, which ``resolve_labels`` maps to the sorted set; one kind per data set.
    """

    def __init__(self, labels: Sequence[str] | None = None, num_labels: int | None = None) -> None:
        self.given = list(labels) if labels is not None else None
        self.index = {n: i for i, n in enumerate(self.given or ())}
        self.num_labels = len(self.given) if self.given is not None else num_labels
        self.kind: str | None = None
        self.kind_at = 0
        self.names: list[str] = []
        self.first: list[int] = []
        self.max = -1

    def encode(self, value: Any, at: int) -> int:
        """The id of ``value`` (of the line identified by ``at``).

        Raises:
            ValueError: the one-line reason why the label is unusable.
        """
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise ValueError(f"key 'label' holds {type(value).__name__}, expected a string or an integer")
        if isinstance(value, int):
            if value < 0 or (self.num_labels is not None and value >= self.num_labels):
                raise ValueError(f"label {value} is outside [0, num_labels = {self.num_labels})"
                                 if value >= 0 else f"label {value} is negative")
            self._kind("int", at)
            self.max = max(self.max, value)
            return value
        if self.given is not None:
            if value not in self.index:
                raise ValueError(f"label {value!r} is not one of the labels {self.given}")
            return self.index[value]
        if not value:
            raise ValueError("key 'label' is empty")
        self._kind("str", at)
        if value not in self.index:
            self.index[value] = len(self.names)
            self.names.append(value)
            self.first.append(at)
        return self.index[value]

    def _kind(self, kind: str, at: int) -> None:
        if self.given is not None:
            return
        if self.kind is None:
            self.kind, self.kind_at = kind, at
        elif self.kind != kind:
            raise ValueError(f"label is {_KINDS[kind]} but earlier labels are {_PLURAL[self.kind]}; use one kind, "
                             "or pass labels")

    def state(self) -> dict[str, Any]:
        """What ``resolve_labels`` needs (JSON-serialisable)."""
        return {"kind": self.kind, "kind_at": self.kind_at, "names": self.names, "first": self.first, "max": self.max}


_KINDS = {"int": "an integer", "str": "a string"}
_PLURAL = {"int": "integers", "str": "strings"}


def resolve_labels(states: Sequence[tuple[dict[str, Any], Callable[[int], tuple[str, int]]]],
                   labels: Sequence[str] | None, num_labels: int | None
                   ) -> tuple[list[str] | None, int, list[np.ndarray | None]]:
    """The label names, the class count and, per state, the map of its local ids to final ids.

    Args:
        states: ``(LabelEncoder.state(), where)`` of consecutive parts of the data; ``where(at)``
            is the ``(file, line)`` of a line.
        labels, num_labels: as given to the encoders.

    Raises:
        BadExampleError: integer and string labels mixed, or more distinct labels than ``num_labels``.
        ValueError: fewer distinct labels than ``num_labels``.
    """
    if labels is not None:
        return list(labels), len(labels), [None] * len(states)
    kinds = [(s["kind"], where(s["kind_at"])) for s, where in states if s["kind"]]
    for kind, at in kinds:
        if kind != kinds[0][0]:
            raise BadExampleError(*at, f"label is {_KINDS[kind]} but earlier labels are {_PLURAL[kinds[0][0]]}; "
                                       "use one kind, or pass labels")
    if not kinds or kinds[0][0] == "int":
        seen = max((s["max"] for s, _ in states), default=-1) + 1
        return None, num_labels if num_labels is not None else max(seen, 2), [None] * len(states)
    first: dict[str, tuple[str, int]] = {}
    for s, where in states:
        for name, at in zip(s["names"], s["first"]):
            first.setdefault(name, where(at))
    names = sorted(first)
    if num_labels is not None and len(names) > num_labels:
        extra = list(first)[num_labels]
        raise BadExampleError(*first[extra], f"label {extra!r} is distinct label number {num_labels + 1} but "
                                             f"num_labels = {num_labels}; pass labels or a larger num_labels")
    if num_labels is not None and len(names) < num_labels:
        raise ValueError(f"the data holds {len(names)} labels {names} but num_labels = {num_labels}; name all "
                         "classes in labels")
    index = {n: i for i, n in enumerate(names)}
    return names, len(names), [np.array([index[n] for n in s["names"]], dtype=np.int64) for s, _ in states]


def parse_classification(raw: bytes | str, path: str, line: int | None, encoder: LabelEncoder, at: int,
                         error: type[BadLineError] = BadExampleError) -> tuple[str, str | None, int]:
    """``(text, text_pair or None, label id)`` of one JSONL line (``at`` identifies it to ``encoder``).

    Raises:
        error: invalid JSON, a missing, non-string or empty ``text`` (or present ``text_pair``),
            or an unusable label (see ``LabelEncoder.encode``).
    """
    obj = load_json_line(raw, path, line, error)
    text = string_field(obj, "text", path, line, error=error)
    pair = string_field(obj, "text_pair", path, line, optional=True, error=error)
    if "label" not in obj:
        raise error(path, line, "missing key 'label'")
    try:
        label = encoder.encode(obj["label"], at)
    except ValueError as e:
        raise error(path, line, str(e)) from None
    return text, pair, label  # type: ignore[return-value]


def tokenize_classification_jsonl(inputs: Sequence[str | os.PathLike[str]], tokenizer: Tokenizer,
                                  labels: Sequence[str] | None = None, num_labels: int | None = None
                                  ) -> ExampleFields:
    """Read and tokenise classification lines in memory (small data; preprocess large data).

    Returns:
        ``ExampleFields`` with fields ``text`` and ``text_pair`` (empty where absent), ``labels``,
        ``label_names`` and ``num_labels`` set, and each example's ``(file, line)``.

    Raises:
        FileNotFoundError: an input is missing. BadExampleError: a bad line (``FILE:LINE: reason``).
    """
    labels = check_label_options(labels, num_labels)
    encoder = LabelEncoder(labels, num_labels)
    out, rows = read_jsonl_examples(inputs, tokenizer, FIELDS,
                                    lambda raw, path, n, k: parse_classification(raw, path, n, encoder, k))
    names, count, (remap,) = resolve_labels([(encoder.state(), out.origins.__getitem__)], labels, num_labels)
    ids = np.array([r[2] for r in rows], dtype=np.int64)
    out.labels = remap[ids] if remap is not None and len(ids) else ids
    out.label_names, out.num_labels = names, count
    return out


def write_labels(parts: Sequence[tuple[str, dict[str, Any], Callable[[int], tuple[str, int]]]], prefix: str,
                 labels: Sequence[str] | None, num_labels: int | None, examples: int, pairs: int,
                 durable: bool = False) -> dict[str, Any]:
    """Merge partial label datasets into ``prefix`` (``PREFIX_label_document``) with final ids and write
    the mapping ``PREFIX_labels.json``; returns what that file holds.

    Args:
        parts: ``(partial prefix, LabelEncoder state, where)`` of every partition, in input order.
        prefix: the preprocessing output prefix.

    Raises:
        BadExampleError / ValueError: as ``resolve_labels``.
    """
    names, count, remaps = resolve_labels([(s, w) for _, s, w in parts], labels, num_labels)
    counts = np.zeros(count, dtype=np.int64)
    with IndexedDatasetBuilder(field_prefix(prefix, LABEL_FIELD, FIELDS), np.int32, durable=durable) as b:
        for (part, _, _), remap in zip(parts, remaps):
            ds = IndexedDataset(part)
            ids = np.asarray(ds.tokens, dtype=np.int64)
            ds.close()
            ids = remap[ids] if remap is not None and len(ids) else ids
            counts += np.bincount(ids, minlength=count)[:count]
            b.add_batch(ids.astype(np.int32), np.ones(len(ids), dtype=np.int64))
    mapping = {"format": "classification", "label_names": names, "num_labels": count,
               "label_counts": counts.tolist(), "examples": examples, "pairs": pairs}
    path = prefix + LABELS_SUFFIX
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(mapping, f, indent=1, ensure_ascii=False)
    os.replace(path + ".tmp", path)
    return mapping


class IndexedClassificationExamples(IndexedExampleFields):
    """A preprocessed classification set: ``PREFIX_text_document`` (+ ``_text_pair_document``),
    ``PREFIX_label_document`` and ``PREFIX_labels.json``.

    Raises:
        IndexedDatasetError / ValueError: as ``IndexedExampleFields``; the labels disagree with the texts.
        FileNotFoundError: ``PREFIX_labels.json`` is missing.
    """

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        super().__init__(prefix, FIELDS, optional=("text_pair",))
        ds = IndexedDataset(field_prefix(self.prefix, LABEL_FIELD, FIELDS))
        if len(ds) != len(self) or not np.array_equal(ds.sequence_lengths, np.ones(len(ds))):
            raise ValueError(f"{ds.prefix}: {len(ds)} labels for {len(self)} examples; preprocess again")
        self.labels = np.asarray(ds.tokens, dtype=np.int64)
        path = self.prefix + LABELS_SUFFIX
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: label mapping not found; preprocess with --format classification")
        with open(path, encoding="utf-8") as f:
            mapping = json.load(f)
        self.label_names, self.num_labels = mapping["label_names"], int(mapping["num_labels"])


def load_classification_examples(path: str | os.PathLike[str], tokenizer: Tokenizer | None = None,
                                 labels: Sequence[str] | None = None, num_labels: int | None = None) -> ExampleFields:
    """The examples of a JSONL file (read in memory, needs ``tokenizer``) or of a preprocessed prefix.

    Raises:
        ValueError: a JSONL file without a tokenizer; and as the readers.
    """
    return load_examples(path, tokenizer, "classification",
                         lambda p, tok: tokenize_classification_jsonl([p], tok, labels, num_labels),
                         IndexedClassificationExamples)


@dataclass(kw_only=True)
class ClassificationDatasetConfig(ExampleDatasetConfig):
    """How classification samples are built, truncated (``truncate``: longest first, as Hugging Face's
    ``truncation=True``), split and shuffled."""

    max_seq_length: int
    """Positions per sample, special tokens included; shorter samples are padded."""
    cls_id: int | None = None
    """BERT style: ``[CLS]`` id opening every sample (with ``sep_id``); None for GPT style."""
    sep_id: int | None = None
    """BERT style: ``[SEP]`` id closing each segment (with ``cls_id``); None for GPT style."""
    pad_id: int = 0
    """Id written into padding positions."""
    separator_ids: Sequence[int] | None = None
    """GPT style: ids between ``text`` and ``text_pair`` (e.g. the EOD id); required when a line has a pair."""
    end_ids: Sequence[int] = ()
    """GPT style: ids closing every sample (e.g. the EOD id), so the label is read at that token."""
    labels: Sequence[str] | None = None
    """The label names in id order; None sorts the string labels found in the data."""
    num_labels: int | None = None
    """Number of classes (checked against the data); None: ``len(labels)`` or what the data holds."""

    def __post_init__(self) -> None:
        if (self.cls_id is None) != (self.sep_id is None):
            raise ValueError("cls_id and sep_id go together: pass both (BERT style) or neither (GPT style)")
        if self.bert_style and (self.separator_ids is not None or self.end_ids):
            raise ValueError("separator_ids and end_ids are for GPT style; BERT style uses cls_id and sep_id")
        if self.separator_ids is not None:
            self.separator_ids = [int(x) for x in self.separator_ids]
        self.end_ids = [int(x) for x in self.end_ids]
        if self.max_seq_length < self.special_tokens(True) + 2:
            raise ValueError(f"max_seq_length must be >= {self.special_tokens(True) + 2} (special tokens and one token "
                             f"of each text), got {self.max_seq_length}")
        self.labels = check_label_options(self.labels, self.num_labels)
        super().__post_init__()
        if self.pad_id < 0:
            raise ValueError(f"pad_id must be a token id (>= 0), got {self.pad_id}")

    @property
    def bert_style(self) -> bool:
        """Whether samples are ``[CLS] text [SEP] text_pair [SEP]`` (else GPT style)."""
        return self.cls_id is not None

    def special_tokens(self, pair: bool) -> int:
        """Positions a sample spends on special tokens, with or without a pair."""
        if self.bert_style:
            return 3 if pair else 2
        return len(self.end_ids) + (len(self.separator_ids or ()) if pair else 0)


def truncate_longest_first(n_a: int, n_b: int, budget: int) -> tuple[int, int]:
    """Lengths kept of a pair of ``n_a`` and ``n_b`` tokens within ``budget``: one token at a time from
    the end of the longer (the second on a tie), as Hugging Face's ``longest_first``."""
    excess = max(n_a + n_b - budget, 0)
    diff = min(abs(n_a - n_b), excess)
    if n_a > n_b:
        n_a -= diff
    else:
        n_b -= diff
    rest = excess - diff
    return n_a - rest // 2, n_b - (rest - rest // 2)


class ClassificationDataset(ExampleDataset):
    """Classification samples, one per example of a range, in a seeded per-epoch order.

    ``ds[i]`` is a dict of numpy arrays (S = ``max_seq_length``), padded on the right:

    * BERT style: ``text`` int64 (S,) ``[CLS] text [SEP] text_pair [SEP]`` (no pair: ``[CLS] text [SEP]``),
      ``types`` int64 (S,) 0 on ``[CLS] text [SEP]`` and padding, 1 on ``text_pair [SEP]``,
      ``padding_mask`` int64 (S,) 1 on real tokens, 0 on padding;
    * GPT style: ``tokens`` int64 (S,) ``text separator_ids text_pair end_ids`` (no pair: ``text end_ids``),
      ``attention_mask`` int64 (S,) 1 on real tokens, 0 on padding (the head reads the last 1);
    * ``label`` int64 (): the class id.

    Too-long examples follow ``config.on_long`` (``truncate``: ``truncate_longest_first``).

    Args:
        examples: ``ExampleFields`` with labels (``tokenize_classification_jsonl``) or
            ``IndexedClassificationExamples``.
        example_range, num_samples, config, name: as ``ExampleDataset``.
        label_names: the names of the final ids (see ``build_classification_datasets``); None takes
            ``config.labels``, else the examples' own. ``self.num_labels`` follows from them.
        num_labels: for integer labels, the class count; None takes ``config.num_labels``, else the examples'.

    Raises:
        BadExampleError / ValueError: a label unknown to ``label_names`` or outside ``num_labels``, a
            GPT-style pair without ``separator_ids``; and as ``ExampleDataset``.
    """

    def __init__(self, examples: ExampleFields, example_range: tuple[int, int], num_samples: int | None,
                 config: ClassificationDatasetConfig, name: str = "train", label_names: Sequence[str] | None = None,
                 num_labels: int | None = None) -> None:
        names = label_names if label_names is not None else config.labels
        count = num_labels if num_labels is not None else config.num_labels
        self.labels, self.label_names, self.num_labels = _final_labels(examples, names, count)
        e0, e1 = example_range
        bad = np.flatnonzero((self.labels[e0:e1] < 0) | (self.labels[e0:e1] >= self.num_labels))
        if len(bad):
            k = e0 + int(bad[0])
            raise examples.error(k, f"label {self.labels[k]} is outside [0, num_labels = {self.num_labels})")
        pairs = examples.lengths.get("text_pair", np.zeros(len(examples), np.int64))[e0:e1] > 0
        if not config.bert_style and config.separator_ids is None and pairs.any():
            raise examples.error(e0 + int(np.flatnonzero(pairs)[0]),
                                 "has a text_pair but separator_ids is not set (GPT style); pass the ids to put "
                                 "between the texts, e.g. [eod]")
        super().__init__(examples, example_range, num_samples, config, name)

    def _lengths(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n_a = self.examples.lengths["text"][ids]
        n_b = self.examples.lengths.get("text_pair", np.zeros(len(self.examples), np.int64))[ids]
        cfg = self.config
        specials = np.where(n_b > 0, cfg.special_tokens(True), cfg.special_tokens(False))
        return n_a, n_b, specials

    def excess(self, ids: np.ndarray) -> np.ndarray:
        n_a, n_b, specials = self._lengths(ids)
        return np.maximum(n_a + n_b + specials - self.config.max_seq_length, 0)

    def too_long_reason(self, i: int) -> str:
        n_a, n_b, specials = (int(x[0]) for x in self._lengths(np.array([i])))
        return (f"example has {n_a + n_b + specials} tokens ({n_a} text, {n_b} text_pair, {specials} special), more "
                f"than max_seq_length = {self.config.max_seq_length}")

    def sample(self, i: int) -> dict[str, np.ndarray]:
        cfg = self.config
        a, b = self.examples.get("text", i), self.examples.get("text_pair", i)
        if len(b):
            n_a, n_b = truncate_longest_first(len(a), len(b), cfg.max_seq_length - cfg.special_tokens(True))
            a, b = a[:n_a], b[:n_b]
        else:
            a = a[:cfg.max_seq_length - cfg.special_tokens(False)]
        s = cfg.max_seq_length
        tokens = np.full(s, cfg.pad_id, dtype=np.int64)
        if cfg.bert_style:
            first = np.concatenate(([cfg.cls_id], a, [cfg.sep_id]))
            seq = np.concatenate((first, b, [cfg.sep_id])) if len(b) else first
        else:
            seq = np.concatenate((a, cfg.separator_ids, b, cfg.end_ids) if len(b) else (a, cfg.end_ids))
        tokens[:len(seq)] = seq
        mask = np.zeros(s, dtype=np.int64)
        mask[:len(seq)] = 1
        label = np.array(self.labels[i], dtype=np.int64)
        if not cfg.bert_style:
            return {"tokens": tokens, "attention_mask": mask, "label": label}
        types = np.zeros(s, dtype=np.int64)
        types[len(first):len(seq)] = 1
        return {"text": tokens, "types": types, "padding_mask": mask, "label": label}


def _final_labels(examples: ExampleFields, names: Sequence[str] | None, num_labels: int | None
                  ) -> tuple[np.ndarray, list[str] | None, int]:
    """The examples' label ids under ``names`` (None: their own), the names and the class count."""
    labels = np.asarray(examples.labels, dtype=np.int64)
    own = examples.label_names
    if names is None:
        names = own
    elif own is not None:
        missing = [n for n in own if n not in names]
        if missing:
            k = int(np.flatnonzero(np.isin(labels, [own.index(n) for n in missing]))[0])
            raise examples.error(k, f"label {own[labels[k]]!r} is not one of the labels {list(names)}")
        labels = np.array([list(names).index(n) for n in own], dtype=np.int64)[labels] if len(labels) else labels
    count = len(names) if names is not None else (num_labels or examples.num_labels or 2)
    if num_labels is not None and count != num_labels:
        raise ValueError(f"{examples.prefix}: the data holds {count} labels {names or ''} but num_labels = "
                         f"{num_labels}; name all classes in labels")
    return labels, (list(names) if names is not None else None), count


def build_classification_datasets(config: ClassificationDatasetConfig, blend: Sequence[str | float] | None = None,
                                  num_samples: Sequence[int | None] = (None, None, None), *,
                                  blend_per_split: Sequence[Sequence[str | float] | None] | None = None,
                                  tokenizer: Tokenizer | None = None) -> list[Any]:
    """Train/valid/test classification datasets sharing one label mapping.

    Args:
        config: dataset options.
        blend: ``[prefix]``, ``[w1, prefix1, w2, prefix2, ...]`` (preprocessing output prefixes or their
            ``_text_document`` prefixes, split and blended as GPT's) or ``[file.jsonl]`` (read in memory
            with ``tokenizer``, cut by ``config.split``).
        num_samples: samples needed per split (None: one epoch of each component).
        blend_per_split: three blends (or None entries) used whole, without ``config.split``; an entry
            ``[valid.jsonl]`` is an explicit validation file.
        tokenizer: needed to read JSONL files.

    Returns:
        Three datasets (``ClassificationDataset``, ``BlendedDataset`` or None); every one returned has
        ``label_names`` (None for integer labels) and ``num_labels``: ``config.labels`` when given,
        else the sorted union of the string labels of every component.

    Raises:
        ValueError: components with integer and string labels, or as ``ClassificationDataset``.
    """
    loaded: dict[str, ExampleFields] = {}

    def load(path: str) -> ExampleFields:
        key = path if os.path.isfile(path) else field_prefix(path, "text", FIELDS)
        if key not in loaded:
            loaded[key] = load_classification_examples(path, tokenizer, config.labels, config.num_labels)
        return loaded[key]

    names, count = config.labels, config.num_labels
    if names is None:
        parts = [load(p) for p in blend_paths(blend, blend_per_split)]
        if len({p.label_names is None for p in parts}) > 1:
            raise ValueError(f"{', '.join(p.prefix for p in parts)}: some have integer and some string labels; "
                             "use one kind, or pass labels")
        if parts and parts[0].label_names is not None:
            names = sorted({n for p in parts for n in p.label_names})  # type: ignore[union-attr]
        elif parts and count is None:
            count = max(p.num_labels or 2 for p in parts)
    out = build_example_datasets(
        config, load, lambda ex, rng, n, name: ClassificationDataset(ex, rng, n, config, name, names, count),
        lambda p: field_prefix(p, "text", FIELDS), blend, num_samples, blend_per_split)
    for d in out:
        if isinstance(d, BlendedDataset):
            d.label_names, d.num_labels = d.datasets[0].label_names, d.datasets[0].num_labels  # type: ignore[attr-defined]
    return out
