"""SFT sample datasets: whole conversations packed into fixed-length samples, with cached indices.

Reads the tokens and loss masks ``mg_data.sft`` writes (or holds in memory). A conversation of
``n`` tokens fills ``n - 1`` positions (inputs ``t[:-1]``, labels ``t[1:]``), so it fits a sample
of ``seq_length`` positions when ``n <= seq_length + 1``.
"""

from __future__ import annotations

import os
from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mg_data.gpt_dataset import build_split_datasets
from mg_data.gpt_indices import parse_split
from mg_data.index_cache import cached_arrays, fingerprint
from mg_data.indexed import dataset_exists
from mg_data.sft import ON_LONG, ConversationList, IndexedConversations, sft_prefixes

PACKING = ("best_fit", "sequential", "none")
_INDEX_VERSION = 1


def pack_sequential(sizes: np.ndarray, capacity: int) -> list[list[int]]:
    """Positions of ``sizes`` grouped in order: a new bin whenever the next item does not fit."""
    bins: list[list[int]] = []
    free = 0
    for i, n in enumerate(sizes.tolist()):
        if n > free or not bins:
            bins.append([])
            free = capacity
        bins[-1].append(i)
        free -= n
    return bins


def pack_best_fit(sizes: np.ndarray, capacity: int) -> list[list[int]]:
    """Positions of ``sizes`` grouped greedily: each item, in order, goes to the open bin with the
    least room that still holds it, else to a new bin (bins in order of creation)."""
    bins: list[list[int]] = []
    rooms: list[int] = []  # sorted distinct free capacities of open bins
    open_bins: dict[int, list[int]] = {}  # free capacity -> bins with it (last opened served first)
    for i, n in enumerate(sizes.tolist()):
        j = bisect_left(rooms, n)
        if j == len(rooms):
            b, room = len(bins), capacity
            bins.append([])
        else:
            room = rooms[j]
            b = open_bins[room].pop()
            if not open_bins[room]:
                del open_bins[room], rooms[j]
        bins[b].append(i)
        room -= n
        if room > 0:
            if room not in open_bins:
                open_bins[room] = []
                insort(rooms, room)
            open_bins[room].append(b)
    return bins


def build_pack_index(ids: np.ndarray, sizes: np.ndarray, capacity: int, num_samples: int | None, seed: int,
                     packing: str, shuffle: bool) -> dict[str, np.ndarray]:
    """CSR index of packed samples over as many epochs as ``num_samples`` needs (one when None).

    Each epoch orders ``ids`` (a permutation from ``default_rng((seed, epoch))`` when ``shuffle``)
    and packs them (``packing``: ``best_fit``, ``sequential`` or ``none`` = one per sample).

    Returns:
        ``pack_items`` (int64, conversation ids) and ``pack_offsets`` (int64, samples + 1):
        sample ``i`` holds ``pack_items[pack_offsets[i]:pack_offsets[i + 1]]``.
    """
    items: list[np.ndarray] = []
    offsets = [np.zeros(1, np.int64)]
    total, epoch = 0, 0
    while epoch == 0 or (num_samples is not None and total < num_samples):
        order = np.random.default_rng((seed, epoch)).permutation(len(ids)) if shuffle else np.arange(len(ids))
        if packing == "none":
            bins = [[i] for i in order.tolist()]
        else:
            pack = pack_best_fit if packing == "best_fit" else pack_sequential
            bins = [[int(order[j]) for j in b] for b in pack(sizes[order], capacity)]
        flat = np.fromiter((i for b in bins for i in b), dtype=np.int64, count=len(ids))
        items.append(ids[flat])
        base = offsets[-1][-1]
        offsets.append(base + np.cumsum([len(b) for b in bins], dtype=np.int64))
        total += len(bins)
        epoch += 1
    return {"pack_items": np.concatenate(items), "pack_offsets": np.concatenate(offsets)}


@dataclass(kw_only=True)
class SFTDatasetConfig:
    """How SFT samples are packed, padded, split, shuffled and cached."""

    seq_length: int
    """Positions per sample; a conversation of n tokens fills n - 1 of them (fits when n <= seq_length + 1)."""
    seed: int = 1234
    """Seed of the per-epoch conversation order."""
    split: str = "969,30,1"
    """Train/valid/test weights over conversations (contiguous ranges)."""
    cache_dir: str | None = None
    """Directory of cached pack indices; None builds them in memory every time."""
    packing: str = "best_fit"
    """``best_fit`` (greedy, fewest pad tokens), ``sequential`` (in order) or ``none`` (one conversation per sample)."""
    shuffle: bool = True
    """False packs conversations in corpus order (debugging)."""
    on_long: str = "error"
    """A conversation over seq_length + 1 tokens: ``error``, ``truncate`` (keep the first seq_length + 1) or ``drop``."""
    pad_id: int = 0
    """Token (and label) id of padding; padding is never in the loss."""
    create_attention_mask: bool = False
    """Also return ``attention_mask`` (bool (1, S, S), True = masked): causal within each conversation."""

    def __post_init__(self) -> None:
        if self.seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {self.seq_length}")
        parse_split(self.split)
        if self.packing not in PACKING:
            raise ValueError(f"packing must be one of {', '.join(PACKING)}, got {self.packing!r}")
        if self.on_long not in ON_LONG:
            raise ValueError(f"on_long must be one of {', '.join(ON_LONG)}, got {self.on_long!r}")
        if self.pad_id < 0:
            raise ValueError(f"pad_id must be a token id (>= 0), got {self.pad_id}")


class SFTDataset:
    """Samples of whole conversations packed into ``seq_length`` positions.

    ``ds[i]`` is a dict of numpy arrays of shape (S,) = (seq_length,): ``tokens`` and ``labels``
    (int64; per conversation ``t[:-1]`` and ``t[1:]``, ``pad_id`` on padding), ``loss_mask``
    (float32; the stored mask of each label token, 0 on padding), ``position_ids`` (int64,
    restarting at 0 for every conversation and for the padding), ``document_ids`` (int64, the
    conversation's rank in the sample, -1 on padding: attend only where equal) and, with
    ``create_attention_mask``, ``attention_mask``. No conversation is split across samples.
    ``len(ds)`` covers whole epochs, so it may exceed ``num_samples``.

    Args:
        conversations: an ``IndexedConversations`` or ``ConversationList``.
        conversation_range: ``[start, end)`` of the conversations this split uses.
        num_samples: samples needed (None: one epoch).
        config: the dataset options.
        name: split name used in cache file names.

    Raises:
        ValueError: the range holds no usable conversation, or one is too long under ``on_long="error"``.
    """

    def __init__(self, conversations: IndexedConversations | ConversationList, conversation_range: tuple[int, int],
                 num_samples: int | None, config: SFTDatasetConfig, name: str = "train") -> None:
        self.conversations, self.config, self.name = conversations, config, name
        c0, c1 = conversation_range
        s = config.seq_length
        lengths = np.asarray(conversations.lengths[c0:c1], dtype=np.int64)
        long = lengths > s + 1
        where = f"{conversations.prefix} ({name} split, conversations {c0}..{c1})"
        if long.any() and config.on_long == "error":
            k = int(np.flatnonzero(long)[0])
            raise ValueError(f"{where}: conversation {c0 + k} has {lengths[k]} tokens, more than seq_length + 1 = "
                             f"{s + 1} ({int(long.sum())} such); set on_long to truncate or drop")
        keep = (lengths >= 2) & ~(long & (config.on_long == "drop"))
        self.num_dropped = int((~keep).sum())
        self.num_truncated = int(long.sum()) if config.on_long == "truncate" else 0
        ids = np.arange(c0, c1, dtype=np.int64)[keep]
        sizes = np.minimum(lengths[keep], s + 1) - 1
        if not len(ids):
            raise ValueError(f"{where}: no conversation to sample from")
        key = fingerprint(_INDEX_VERSION, lengths, c0, s, config.seed, num_samples, config.packing, config.shuffle,
                          config.on_long)
        stem = f"sft-{os.path.basename(conversations.prefix)}-{name}"
        arrays, self.built_index = cached_arrays(
            config.cache_dir, stem, key, ("pack_items", "pack_offsets"),
            lambda: build_pack_index(ids, sizes, s, num_samples, config.seed, config.packing, config.shuffle),
            {"prefix": conversations.prefix, "split": name, "conversations": [c0, c1], "num_samples": num_samples,
             "seq_length": s, "packing": config.packing})
        self.pack_items = np.asarray(arrays["pack_items"])
        self.pack_offsets = np.asarray(arrays["pack_offsets"])
        self.cache_key = key

    def __len__(self) -> int:
        return len(self.pack_offsets) - 1

    def conversation_sample(self, c: int) -> dict[str, np.ndarray]:
        """Unpadded ``tokens``, ``labels``, ``loss_mask`` and ``position_ids`` of conversation ``c`` alone."""
        tokens, mask = self.conversations.get(c)
        tokens = np.asarray(tokens[: self.config.seq_length + 1], dtype=np.int64)
        n = len(tokens) - 1
        return {"tokens": tokens[:-1], "labels": tokens[1:], "loss_mask": mask[1:n + 1].astype(np.float32),
                "position_ids": np.arange(n, dtype=np.int64)}

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        """Sample ``idx`` (see the class docstring for the keys)."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range [0, {len(self)}) of {self.name} split")
        s = self.config.seq_length
        out = {"tokens": np.full(s, self.config.pad_id, np.int64), "labels": np.full(s, self.config.pad_id, np.int64),
               "loss_mask": np.zeros(s, np.float32), "position_ids": np.zeros(s, np.int64),
               "document_ids": np.full(s, -1, np.int64)}
        pos = 0
        for k, c in enumerate(self.pack_items[self.pack_offsets[idx]:self.pack_offsets[idx + 1]].tolist()):
            one = self.conversation_sample(c)
            n = len(one["tokens"])
            for name, arr in one.items():
                out[name][pos:pos + n] = arr
            out["document_ids"][pos:pos + n] = k
            pos += n
        out["position_ids"][pos:] = np.arange(s - pos)
        if self.config.create_attention_mask:
            doc = out["document_ids"]
            out["attention_mask"] = ~(np.tri(s, dtype=bool) & (doc[:, None] == doc[None, :]))[None]
        return out


def build_sft_datasets(config: SFTDatasetConfig, blend: Sequence[str | float] | None = None,
                       num_samples: Sequence[int | None] = (None, None, None), *,
                       blend_per_split: Sequence[Sequence[str | float] | None] | None = None
                       ) -> list[Any]:
    """Train/valid/test SFT datasets from preprocessed prefixes, split and blended as GPT's.

    Args:
        config: dataset options.
        blend: ``[prefix]`` or ``[w1, prefix1, w2, prefix2, ...]``; a prefix is the output prefix
            of ``mg preprocess --format sft`` (or its ``_text_document`` prefix).
        num_samples: samples needed per split (None: one epoch of each component).
        blend_per_split: three blends (or None entries) used whole, without ``config.split``.

    Returns:
        Three datasets (``SFTDataset``, ``BlendedDataset`` or None, as ``build_gpt_datasets``).

    Raises:
        ValueError / IndexedDatasetError: as ``SFTDataset`` and ``IndexedConversations``.
    """
    def tokens_prefix(blend_: Sequence[str | float] | None) -> list[str | float] | None:
        if blend_ is None:
            return None
        return [sft_prefixes(x)[0] if isinstance(x, str) and dataset_exists(sft_prefixes(x)[0]) else x
                for x in blend_]

    per_split = None if blend_per_split is None else [tokens_prefix(b) for b in blend_per_split]
    return build_split_datasets(
        config, lambda ds, rng, n, name: SFTDataset(IndexedConversations(ds.prefix), rng, n, config, name),
        tokens_prefix(blend), num_samples, per_split)
