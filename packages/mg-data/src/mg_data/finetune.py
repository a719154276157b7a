"""What the classification and seq2seq formats share: examples made of token fields, held in memory or
preprocessed, one sample per example in a seeded per-epoch order, and train/valid/test building.

An example is one JSONL line; each of its text fields (``text`` and ``text_pair``, or ``input`` and
``target``) is tokenised without special tokens. Preprocessing stores field ``F`` as the indexed
dataset ``PREFIX_F_document``, one sequence per example (an absent optional field is an empty
sequence), so every field has the same number of documents. Special tokens, padding and the length
policy are applied when a sample is read, so one preprocessed set serves any sequence length.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from mg_data.gpt_dataset import SPLIT_NAMES, build_split_datasets, parse_blend
from mg_data.gpt_indices import parse_split, split_ranges
from mg_data.indexed import IndexedDataset, dataset_exists
from mg_data.jsonl import BadLineError, expand_inputs, open_binary, values_of
from mg_data.sft import ON_LONG
from mg_data.tokenizers import Tokenizer

_BATCH_CHARS = 1 << 22  # characters tokenised per call, so the token lists stay small


class BadExampleError(BadLineError):
    """A fine-tuning example is malformed or cannot be used; one line, ``FILE:LINE: reason``.

    Attributes as ``BadLineError`` (of which it is a subclass, and so a ``ValueError``).
    """

    hint = ""


def string_field(obj: Any, key: str, path: str, line: int | None, *, optional: bool = False,
                 error: type[BadLineError] = BadExampleError) -> str | None:
    """``obj[key]`` as a string holding more than whitespace; None when ``optional`` and absent or null.

    Raises:
        error: ``obj`` is not an object, or the key is missing, not a string or empty.
    """
    if optional and isinstance(obj, dict) and obj.get(key) is None:
        return None
    (value,) = values_of(obj, [key], path, line, error)
    if not value.strip():
        raise error(path, line, f"key {key!r} is empty")
    return value


def encode_texts(tokenizer: Tokenizer, texts: Sequence[str | None], dtype: Any = np.int64
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of ``texts`` back to back (``dtype``) and the tokens of each (int64); None gives none.

    Texts are encoded in batches of about 4 M characters.
    """
    flats, lengths = [], np.zeros(len(texts), dtype=np.int64)
    start = chars = 0
    for end in range(1, len(texts) + 1):
        chars += len(texts[end - 1] or "")
        if chars < _BATCH_CHARS and end < len(texts):
            continue
        batch = [(k, t) for k, t in enumerate(texts[start:end], start) if t is not None]
        ids = tokenizer.encode_batch([t for _, t in batch]) if batch else []
        for (k, _), x in zip(batch, ids):
            lengths[k] = len(x)
        n = sum(len(x) for x in ids)
        flats.append(np.fromiter(chain.from_iterable(ids), dtype=dtype, count=n))
        start, chars = end, 0
    return (np.concatenate(flats) if flats else np.zeros(0, dtype)), lengths


class ExampleFields:
    """Token fields of examples held in memory (small data; the twin of ``IndexedExampleFields``).

    Args:
        fields: per field name, one int array per example (all fields of equal count).
        origins: ``(file, line)`` of each example, so errors name the line; None names the index.
        name: what errors call this set.

    Raises:
        ValueError: the fields have different numbers of examples.
    """

    labels: np.ndarray | None = None
    """Classification: label id of each example (int64), into ``label_names`` when it is set."""
    label_names: list[str] | None = None
    """Classification: the names of the label ids; None for integer labels."""
    num_labels: int | None = None
    """Classification: the number of classes."""

    def __init__(self, fields: Mapping[str, Sequence[np.ndarray]], origins: Sequence[tuple[str, int]] | None = None,
                 name: str = "memory") -> None:
        self.fields = {k: [np.asarray(x, dtype=np.int64) for x in v] for k, v in fields.items()}
        counts = {len(v) for v in self.fields.values()}
        if len(counts) > 1:
            raise ValueError(f"{name}: fields hold different numbers of examples ({sorted(counts)})")
        self.lengths = {k: np.array([len(x) for x in v], dtype=np.int64) for k, v in self.fields.items()}
        self.origins = list(origins) if origins is not None else None
        self.prefix = name

    def __len__(self) -> int:
        return len(next(iter(self.lengths.values()), ()))

    def get(self, field: str, i: int) -> np.ndarray:
        """Tokens of ``field`` of example ``i`` (empty when the field is absent)."""
        return self.fields[field][i] if field in self.fields else np.zeros(0, dtype=np.int64)

    def error(self, i: int, reason: str) -> ValueError:
        """The error to raise about example ``i``: ``FILE:LINE: reason`` when its origin is known."""
        if self.origins is not None:
            return BadExampleError(*self.origins[i], reason)
        return ValueError(f"{self.prefix}: example {i}: {reason}")


def read_jsonl_examples(inputs: Sequence[str | os.PathLike[str]], tokenizer: Tokenizer, fields: Sequence[str],
                        parse: Callable[[bytes, str, int, int], tuple[Any, ...]]) -> tuple[ExampleFields, list[Any]]:
    """Parse every non-blank line of ``inputs`` with ``parse(raw, file, line, example index)`` (its first
    values are the texts of ``fields``) and tokenise the texts in memory.

    Returns:
        The ``ExampleFields`` (with each example's ``(file, line)``) and the parsed rows.

    Raises:
        FileNotFoundError: an input is missing. BadExampleError: as ``parse``.
    """
    rows, origins = [], []
    for path in expand_inputs(inputs):
        with open_binary(path) as f:
            for n, raw in enumerate(f, 1):
                if raw.strip():
                    rows.append(parse(raw, path, n, len(rows)))
                    origins.append((path, n))
    tokens = {}
    for k, field in enumerate(fields):
        flat, lengths = encode_texts(tokenizer, [r[k] for r in rows])
        tokens[field] = np.split(flat, np.cumsum(lengths)[:-1]) if rows else []
    return ExampleFields(tokens, origins, name=", ".join(map(str, inputs))), rows


def load_examples(path: str | os.PathLike[str], tokenizer: Tokenizer | None, fmt: str,
                  read_jsonl: Callable[[str, Tokenizer], ExampleFields], open_prefix: Callable[[str], ExampleFields]
                  ) -> ExampleFields:
    """The examples of a JSONL file (``read_jsonl``, needs ``tokenizer``) or of a prefix (``open_prefix``).

    Raises:
        ValueError: a JSONL file without a tokenizer; and as the readers.
    """
    p = os.fspath(path)
    if not os.path.isfile(p):
        return open_prefix(p)
    if tokenizer is None:
        raise ValueError(f"{p}: reading JSONL needs a tokenizer; pass tokenizer=, or preprocess it with "
                         f"mg preprocess --format {fmt}")
    return read_jsonl(p, tokenizer)


def field_prefix(prefix: str | os.PathLike[str], field: str, fields: Sequence[str]) -> str:
    """``PREFIX_{field}_document`` of a preprocessing output prefix, or of one of its field prefixes."""
    p = os.fspath(prefix)
    for f in fields:
        if p.endswith(f"_{f}_document"):
            p = p[: -len(f"_{f}_document")]
            break
    return f"{p}_{field}_document"


class IndexedExampleFields(ExampleFields):
    """Preprocessed examples: ``PREFIX_{field}_document`` per field, one sequence per example.

    Args:
        prefix: the output prefix given to preprocessing, or one of its field prefixes.
        fields: field names; ``optional`` ones may be missing (read as empty).

    Raises:
        IndexedDatasetError: a file is missing or malformed. ValueError: the fields' example counts
            differ, or documents are not single sequences.
    """

    def __init__(self, prefix: str | os.PathLike[str], fields: Sequence[str], optional: Sequence[str] = ()) -> None:
        self.prefix = field_prefix(prefix, fields[0], fields)[: -len(f"_{fields[0]}_document")]
        self.origins = None
        self.datasets: dict[str, IndexedDataset] = {}
        for f in fields:
            p = field_prefix(self.prefix, f, fields)
            if f not in optional or dataset_exists(p):
                self.datasets[f] = IndexedDataset(p)
        first = self.datasets[fields[0]]
        for ds in self.datasets.values():
            if not np.array_equal(ds.document_indices, np.arange(len(first) + 1)):
                raise ValueError(f"{ds.prefix}: not a fine-tuning dataset (one sequence per example needed, "
                                 f"{len(ds)} sequences in {ds.num_documents} documents, {len(first)} examples in "
                                 f"{first.prefix}); preprocess the JSONL again")
        self.lengths = {f: np.asarray(ds.sequence_lengths, dtype=np.int64) for f, ds in self.datasets.items()}
        self.fields = {}

    def get(self, field: str, i: int) -> np.ndarray:
        ds = self.datasets.get(field)
        return np.zeros(0, dtype=np.int64) if ds is None else ds.get(i).astype(np.int64)


def epoch_order(ids: np.ndarray, num_samples: int | None, seed: int, shuffle: bool) -> np.ndarray:
    """``ids`` repeated for as many whole epochs as ``num_samples`` needs (one when None), epoch ``e``
    permuted by ``numpy.random.default_rng((seed, e))`` when ``shuffle``."""
    epochs = 1 if num_samples is None else max(1, -(-num_samples // len(ids)))
    return np.concatenate([ids[np.random.default_rng((seed, e)).permutation(len(ids))] if shuffle else ids
                           for e in range(epochs)])


@dataclass(kw_only=True)
class ExampleDatasetConfig:
    """What every example dataset config holds: the length policy, order, split and cache."""

    on_long: str = "error"
    """A too-long example: ``error`` (names it), ``truncate`` (cut, see the config) or ``drop``."""
    seed: int = 1234
    """Seed of the per-epoch example order."""
    split: str = "969,30,1"
    """Train/valid/test weights over examples (contiguous ranges)."""
    shuffle: bool = True
    """False serves examples in corpus order (debugging)."""
    cache_dir: str | None = None
    """Directory of cached blending indices (blends of several prefixes)."""

    def __post_init__(self) -> None:
        if self.on_long not in ON_LONG:
            raise ValueError(f"on_long must be one of {', '.join(ON_LONG)}, got {self.on_long!r}")
        parse_split(self.split)


class ExampleDataset:
    """One sample per example of a range, in a seeded per-epoch order; subclasses say how long an
    example is (``excess``) and build its sample (``sample``).

    ``len(ds)`` covers whole epochs, so it may exceed ``num_samples``. Too-long examples follow
    ``config.on_long``: ``error`` raises naming the first, ``drop`` leaves them out, ``truncate``
    keeps them (``sample`` cuts them). ``num_dropped`` and ``num_truncated`` count them.

    Raises:
        BadExampleError / ValueError: a too-long example under ``error`` (``FILE:LINE`` for examples read
            from JSONL in memory), or a range without a usable example.
    """

    def __init__(self, examples: ExampleFields, example_range: tuple[int, int], num_samples: int | None,
                 config: Any, name: str = "train") -> None:
        self.examples, self.config, self.name = examples, config, name
        e0, e1 = example_range
        ids = np.arange(e0, e1, dtype=np.int64)
        over = self.excess(ids)
        long = over > 0
        if long.any() and config.on_long == "error":
            k = int(ids[np.flatnonzero(long)[0]])
            raise examples.error(k, f"{self.too_long_reason(k)} ({int(long.sum())} such in the {name} split); "
                                    "set on_long to truncate or drop")
        keep = ~long if config.on_long == "drop" else np.ones(len(ids), dtype=bool)
        self.num_dropped = int((~keep).sum())
        self.num_truncated = int(long.sum()) if config.on_long == "truncate" else 0
        if not keep.any():
            raise ValueError(f"{examples.prefix} ({name} split, examples {e0}..{e1}): no example to sample from")
        self.order = epoch_order(ids[keep], num_samples, config.seed, config.shuffle)

    def excess(self, ids: np.ndarray) -> np.ndarray:
        """Tokens by which each example of ``ids`` exceeds the sample (0 where it fits), int64."""
        raise NotImplementedError

    def too_long_reason(self, i: int) -> str:
        """Why example ``i`` does not fit."""
        raise NotImplementedError

    def sample(self, i: int) -> dict[str, np.ndarray]:
        """The sample of example ``i``."""
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        """Sample ``idx`` of the shuffled order."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range [0, {len(self)}) of {self.name} split")
        return self.sample(int(self.order[idx]))


def is_jsonl_entry(blend: Sequence[str | float] | None) -> bool:
    """Whether ``blend`` names a single JSONL file (read in memory) rather than preprocessed prefixes.

    Raises:
        ValueError: a weighted blend names a file (blends need preprocessed data).
    """
    if not blend:
        return False
    prefixes, _ = parse_blend(blend)
    files = [p for p in prefixes if os.path.isfile(p)]
    if files and len(prefixes) > 1:
        raise ValueError(f"blend {list(map(str, blend))} names the JSONL file {files[0]}; blends need preprocessed "
                         "data (mg preprocess), or pass a single JSONL file")
    return bool(files)


def blend_paths(blend: Sequence[str | float] | None, blend_per_split: Sequence[Sequence[str | float] | None] | None
                ) -> list[str]:
    """Every prefix or file the blends name, in order, each once.

    Raises:
        ValueError: as ``is_jsonl_entry``.
    """
    out: list[str] = []
    for b in [blend] + list(blend_per_split or ()):
        if b:
            is_jsonl_entry(b)  # refuses a weighted blend that names a file
            out += [p for p in parse_blend(b)[0] if p not in out]
    return out


def build_example_datasets(config: Any, load: Callable[[str], ExampleFields],
                           make: Callable[[ExampleFields, tuple[int, int], int | None, str], Any],
                           main_prefix: Callable[[str], str], blend: Sequence[str | float] | None,
                           num_samples: Sequence[int | None],
                           blend_per_split: Sequence[Sequence[str | float] | None] | None) -> list[Any]:
    """Train/valid/test datasets of examples from preprocessed prefixes or single JSONL files.

    Prefixes are split and blended as GPT's (``build_split_datasets``). A blend of one JSONL file is
    read in memory and cut into contiguous example ranges by ``config.split``; a ``blend_per_split``
    entry of one JSONL file is that split whole (an explicit validation file).

    Args:
        load: the examples of a prefix or JSONL file. make: a dataset of a range of examples.
        main_prefix: the indexed prefix that stands for a preprocessing output prefix.

    Raises:
        ValueError: both or neither blend given, a weighted blend naming a file, and as ``build_split_datasets``.
    """
    if (blend is None) == (blend_per_split is None):
        raise ValueError("pass exactly one of blend and blend_per_split")
    if is_jsonl_entry(blend):
        examples = load(str(blend[0]))  # type: ignore[index]
        ranges = split_ranges(len(examples), parse_split(config.split))
        return [make(examples, r, n, name) if r[0] < r[1] else None
                for r, n, name in zip(ranges, num_samples, SPLIT_NAMES)]

    def indexed(b: Sequence[str | float] | None) -> list[str | float] | None:
        if b is None or is_jsonl_entry(b):
            return None
        return [main_prefix(x) if isinstance(x, str) and not _is_weight(x) else x for x in b]

    per_split = None if blend_per_split is None else [indexed(b) for b in blend_per_split]
    out = build_split_datasets(config, lambda ds, rng, n, name: make(load(ds.prefix), rng, n, name),
                               indexed(blend), num_samples, per_split)
    for s, b in enumerate(blend_per_split or ()):
        if is_jsonl_entry(b):
            examples = load(str(b[0]))  # type: ignore[index]
            out[s] = make(examples, (0, len(examples)), num_samples[s], SPLIT_NAMES[s])
    return out


def _is_weight(x: str) -> bool:
    try:
        float(x)
    except ValueError:
        return False
    return True
