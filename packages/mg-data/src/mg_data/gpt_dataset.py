"""GPT sample datasets: fixed-length samples drawn across document boundaries, with cached indices."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mg_data.blended import BlendedDataset
from mg_data.gpt_indices import build_gpt_indices, parse_split, split_ranges
from mg_data.index_cache import cached_arrays, fingerprint
from mg_data.indexed import IndexedDataset

_INDEX_VERSION = 1
SPLIT_NAMES = ("train", "valid", "test")


@dataclass(kw_only=True)
class GPTDatasetConfig:
    """How GPT samples are cut, shuffled, split, masked and cached."""

    seq_length: int
    """Tokens per sample fed to the model; each sample reads seq_length + 1 tokens."""
    seed: int = 1234
    """Seed of document and sample shuffling."""
    split: str = "969,30,1"
    """Train/valid/test weights over documents (contiguous document ranges)."""
    cache_dir: str | None = None
    """Directory of cached index files; None builds them in memory every time."""
    shuffle: bool = True
    """False serves documents and samples in corpus order (debugging)."""
    separate_final_epoch_threshold: float = 0.80
    """Shuffle a final epoch apart when it supplies fewer than this share of an epoch (0: never)."""
    reset_position_ids: bool = False
    """Restart position ids after every end-of-document token."""
    reset_attention_mask: bool = False
    """Forbid attention across end-of-document tokens (returns ``attention_mask``)."""
    eod_mask_loss: bool = False
    """Zero the loss mask where the input token is the end-of-document token."""
    create_attention_mask: bool = False
    """Return a causal ``attention_mask`` even without reset_attention_mask."""
    eod_id: int | None = None
    """End-of-document id; required by reset_position_ids, reset_attention_mask and eod_mask_loss."""

    def __post_init__(self) -> None:
        if self.seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {self.seq_length}")
        parse_split(self.split)
        if not 0 <= self.separate_final_epoch_threshold <= 1:
            raise ValueError(f"separate_final_epoch_threshold must be in [0, 1], got "
                             f"{self.separate_final_epoch_threshold}")
        if (self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss) and self.eod_id is None:
            raise ValueError("eod_id is required by reset_position_ids/reset_attention_mask/eod_mask_loss; "
                             "pass the tokenizer's eod id")


class GPTDataset:
    """Samples of ``seq_length + 1`` consecutive tokens from a range of documents of a corpus.

    ``ds[i]`` is a dict of numpy arrays of length ``seq_length``: ``tokens`` (int64), ``labels``
    (int64, tokens shifted by one), ``loss_mask`` (float32), ``position_ids`` (int64) and, when
    configured, ``attention_mask`` (bool, shape (1, S, S), True where attention is NOT allowed,
    Megatron's convention). ``len(ds)`` covers whole epochs, so it may exceed ``num_samples``.

    Args:
        indexed: the corpus.
        document_range: ``[start, end)`` of the documents this split uses.
        num_samples: samples needed (None: one epoch).
        config: the dataset options.
        name: split name used in cache file names.

    Raises:
        ValueError: the range holds fewer than ``seq_length + 1`` tokens.
    """

    def __init__(self, indexed: IndexedDataset, document_range: tuple[int, int], num_samples: int | None,
                 config: GPTDatasetConfig, name: str = "train") -> None:
        self.indexed, self.config, self.name = indexed, config, name
        d0, d1 = document_range
        di = indexed.document_indices
        self.sequence_range = (int(di[d0]), int(di[d1]))
        s0, s1 = self.sequence_range
        lengths = np.asarray(indexed.sequence_lengths[s0:s1])
        key = fingerprint(_INDEX_VERSION, lengths, s0, config.seq_length, config.seed, num_samples, config.shuffle,
                          config.separate_final_epoch_threshold)
        stem = f"gpt-{os.path.basename(indexed.prefix)}-{name}"
        def build() -> dict[str, np.ndarray]:
            try:
                return build_gpt_indices(lengths, s0, config.seq_length, num_samples, config.seed, config.shuffle,
                                         config.separate_final_epoch_threshold)
            except ValueError as e:
                raise ValueError(f"{indexed.prefix} ({name} split, documents {d0}..{d1}): {e}") from None

        arrays, self.built_index = cached_arrays(
            config.cache_dir, stem, key, ("document_index", "sample_index", "shuffle_index"), build,
            {"prefix": indexed.prefix, "split": name, "sequences": [s0, s1], "num_samples": num_samples,
             "seq_length": config.seq_length, "seed": config.seed})
        # plain ndarray views of the (possibly memory-mapped) arrays: cheaper element access
        self.document_index = np.asarray(arrays["document_index"])
        self.sample_index = np.asarray(arrays["sample_index"])
        self.shuffle_index = np.asarray(arrays["shuffle_index"])
        self._tokens = indexed.tokens
        self._itemsize = indexed.dtype.itemsize
        self.cache_key = key
        self._cache_base = os.path.join(config.cache_dir, f"{stem}-{key}") if config.cache_dir else None

    def __getstate__(self) -> dict[str, Any]:
        # With a cache, pickle paths rather than arrays (spawned DataLoader workers re-map the files).
        state = self.__dict__.copy()
        del state["_tokens"]
        if self._cache_base is not None:
            for n in ("document_index", "sample_index", "shuffle_index"):
                state[n] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._tokens = self.indexed.tokens
        if self._cache_base is not None:
            for n in ("document_index", "sample_index", "shuffle_index"):
                setattr(self, n, np.asarray(np.load(f"{self._cache_base}-{n}.npy", mmap_mode="r")))

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def sample_tokens(self, i: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of unshuffled sample ``i`` (int64)."""
        j0, o0, j1, o1 = self.sample_index[i:i + 2].ravel().tolist()
        doc = self.document_index[j0:j1 + 1].tolist()
        starts = (self.indexed.sequence_pointers[doc] // self._itemsize).tolist()
        tokens = self._tokens
        if j0 == j1:
            return tokens[starts[0] + o0:starts[0] + o1 + 1].astype(np.int64)
        ends = (np.asarray(starts[:-1]) + self.indexed.sequence_lengths[doc[:-1]]).tolist()
        out = np.empty(self.config.seq_length + 1, dtype=np.int64)
        pos = 0
        pieces = [(starts[0] + o0, ends[0])] + list(zip(starts[1:-1], ends[1:])) + [(starts[-1], starts[-1] + o1 + 1)]
        for a, b in pieces:
            out[pos:pos + b - a] = tokens[a:b]
            pos += b - a
        return out

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        """Sample ``idx`` of the shuffled order (see the class docstring for the keys)."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range [0, {len(self)}) of {self.name} split")
        text = self.sample_tokens(int(self.shuffle_index[idx]))
        return make_sample(text, self.config)


def make_sample(text: np.ndarray, config: GPTDatasetConfig) -> dict[str, np.ndarray]:
    """Inputs, labels and masks from ``seq_length + 1`` tokens (as Megatron's left-to-right masks)."""
    tokens, labels = text[:-1], text[1:]
    s = len(tokens)
    loss_mask = np.ones(s, dtype=np.float32)
    eod = config.eod_id
    if not (config.eod_mask_loss or config.reset_position_ids or config.reset_attention_mask
            or config.create_attention_mask):
        return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
                "position_ids": np.arange(s, dtype=np.int64)}
    is_eod = tokens == eod if eod is not None else np.zeros(s, dtype=bool)
    if config.eod_mask_loss:
        loss_mask[is_eod] = 0.0
    # segment[i] = number of EOD tokens strictly before position i
    segment = np.concatenate(([0], np.cumsum(is_eod[:-1]))) if s else np.zeros(0, np.int64)
    if config.reset_position_ids and is_eod.any():
        starts = np.concatenate(([0], np.flatnonzero(is_eod[:-1]) + 1))
        position_ids = np.arange(s, dtype=np.int64) - starts[segment]
    else:
        position_ids = np.arange(s, dtype=np.int64)
    out = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
    if config.reset_attention_mask or config.create_attention_mask:
        allowed = np.tri(s, dtype=bool)
        if config.reset_attention_mask:
            allowed &= segment[:, None] == segment[None, :]
        out["attention_mask"] = ~allowed[None]
    return out


def parse_blend(blend: Sequence[str | float]) -> tuple[list[str], list[float]]:
    """Megatron's ``[w1, prefix1, w2, prefix2, ...]`` (or ``[prefix]``) as (prefixes, normalised weights).

    Raises:
        ValueError: odd length, a non-numeric weight, a negative weight or a zero sum.
    """
    items = [str(x) for x in blend]
    if len(items) == 1:
        return items, [1.0]
    if len(items) % 2:
        raise ValueError(f"blend {items} must be 'weight prefix' pairs or a single prefix")
    try:
        weights = [float(w) for w in items[0::2]]
    except ValueError:
        raise ValueError(f"blend {items}: every other entry must be a weight") from None
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"blend {items}: weights must be non-negative with a positive sum")
    return items[1::2], [w / sum(weights) for w in weights]


def build_split_datasets(config: Any, make: Callable[[IndexedDataset, tuple[int, int], int | None, str], Any],
                         blend: Sequence[str | float] | None, num_samples: Sequence[int | None],
                         blend_per_split: Sequence[Sequence[str | float] | None] | None) -> list[Any]:
    """Train/valid/test datasets (``make(indexed, document_range, num_samples, split_name)`` each),
    blended when a blend names several prefixes (the splitting rules every family shares).

    Raises:
        ValueError: both or neither blend given, a blend without num_samples, or a split without
            documents in a blend.
    """
    if (blend is None) == (blend_per_split is None):
        raise ValueError("pass exactly one of blend and blend_per_split")
    out: list[Any] = []
    weights = parse_split(config.split)
    for s, name in enumerate(SPLIT_NAMES):
        if blend_per_split is not None:
            this = blend_per_split[s]
            if not this:
                out.append(None)
                continue
            prefixes, mix = parse_blend(this)
            ranges = None
        else:
            if weights[s] == 0:
                out.append(None)
                continue
            prefixes, mix = parse_blend(blend)  # type: ignore[arg-type]
            ranges = weights
        n = num_samples[s]
        if len(prefixes) > 1 and n is None:
            raise ValueError(f"{name}: a blend of several datasets needs num_samples for that split")
        counts = BlendedDataset.required_samples(mix, n) if len(prefixes) > 1 else [n]
        parts = []
        for p, count in zip(prefixes, counts):
            ds = IndexedDataset(p)
            rng = (0, ds.num_documents) if ranges is None else split_ranges(ds.num_documents, ranges)[s]
            if rng[0] == rng[1]:
                if len(prefixes) > 1:
                    raise ValueError(f"{p}: the {name} split holds no document; adjust --split")
                break
            parts.append(make(ds, rng, count, name))
        if not parts:
            out.append(None)
        elif len(parts) == 1:
            out.append(parts[0])
        else:
            out.append(BlendedDataset(parts, mix, n, cache_dir=config.cache_dir, name=name))  # type: ignore[arg-type]
    return out


def build_gpt_datasets(config: GPTDatasetConfig, blend: Sequence[str | float] | None = None,
                       num_samples: Sequence[int | None] = (None, None, None), *,
                       blend_per_split: Sequence[Sequence[str | float] | None] | None = None
                       ) -> list[GPTDataset | BlendedDataset | None]:
    """Train/valid/test datasets from one blend cut by ``config.split``, or one blend per split.

    Args:
        config: dataset options.
        blend: ``[prefix]`` or ``[w1, prefix1, w2, prefix2, ...]``; each prefix is split by documents.
        num_samples: samples needed per split (None: one epoch of each component).
        blend_per_split: three blends (or None entries) used whole, without ``config.split``.

    Returns:
        Three datasets (None for a split with zero weight or no blend); a ``BlendedDataset`` when a
        blend has several prefixes.
    """
    return build_split_datasets(config, lambda ds, rng, n, name: GPTDataset(ds, rng, n, config, name),
                                blend, num_samples, blend_per_split)
