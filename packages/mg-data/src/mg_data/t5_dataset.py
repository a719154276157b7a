"""T5 sample datasets: span corruption (the T5 paper's objective) over packed documents, cached indices."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mg_data.blended import BlendedDataset
from mg_data.gpt_dataset import build_split_datasets
from mg_data.gpt_indices import SEPARATE_FINAL_EPOCH_THRESHOLD, build_gpt_indices, parse_split
from mg_data.index_cache import cached_arrays, fingerprint
from mg_data.indexed import IndexedDataset
from mg_data.masking import IGNORE_INDEX, random_spans_helper, span_corrupt

_INDEX_VERSION = 1
_ARRAYS = ("document_index", "sample_index", "shuffle_index")


@dataclass(kw_only=True)
class T5DatasetConfig:
    """How T5 samples are read, corrupted, padded, split and cached."""

    encoder_seq_length: int
    """Encoder input length (the T5 paper's ``inputs_length``); the raw tokens read per sample and the
    decoder length follow from it (``raw_length``, ``decoder_length``)."""
    sentinel_ids: Sequence[int]
    """Ids replacing noise spans, span k gets ``sentinel_ids[k]`` (T5's ``<extra_id_k>``); needs at
    least as many as there are spans per sample (``num_noise_spans``)."""
    eos_id: int
    """End-of-sequence id closing encoder input and targets."""
    pad_id: int
    """Id written into padding positions."""
    decoder_start_id: int | None = None
    """First decoder input id; None uses ``pad_id`` as T5 does."""
    noise_density: float = 0.15
    """Share of raw tokens that are noise (masked)."""
    mean_noise_span_length: float = 3.0
    """Mean length of a noise span."""
    decoder_seq_length: int | None = None
    """Pad decoder arrays to this length (>= ``decoder_length``); None: exactly ``decoder_length``."""
    seed: int = 1234
    """Seed of document and sample shuffling; sample i's noise comes from a generator seeded by (seed, i)."""
    split: str = "969,30,1"
    """Train/valid/test weights over documents (contiguous document ranges)."""
    cache_dir: str | None = None
    """Directory of cached index files; None builds them in memory every time."""
    shuffle: bool = True
    """False serves documents and samples in corpus order (debugging)."""
    separate_final_epoch_threshold: float = SEPARATE_FINAL_EPOCH_THRESHOLD
    """Shuffle a final epoch apart when it supplies fewer than this share of an epoch (0: never)."""
    raw_length: int = field(init=False)
    """Raw tokens read per sample (derived)."""
    decoder_length: int = field(init=False)
    """Targets length: noise tokens + one sentinel per span + EOS (derived)."""
    num_noise_spans: int = field(init=False)
    """Noise spans per sample (derived)."""

    def __post_init__(self) -> None:
        if self.encoder_seq_length < 4:
            raise ValueError(f"encoder_seq_length must be >= 4, got {self.encoder_seq_length}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        parse_split(self.split)
        if not 0 <= self.separate_final_epoch_threshold <= 1:
            raise ValueError(f"separate_final_epoch_threshold must be in [0, 1], got "
                             f"{self.separate_final_epoch_threshold}")
        self.raw_length, self.decoder_length = random_spans_helper(self.encoder_seq_length, self.noise_density,
                                                                   self.mean_noise_span_length)
        noise = int(round(self.raw_length * self.noise_density))
        self.num_noise_spans = int(round(noise / self.mean_noise_span_length))
        self.sentinel_ids = [int(x) for x in self.sentinel_ids]
        if len(self.sentinel_ids) < self.num_noise_spans:
            raise ValueError(f"sentinel_ids has {len(self.sentinel_ids)} ids but samples of encoder_seq_length "
                             f"{self.encoder_seq_length} hold {self.num_noise_spans} noise spans; pass more "
                             "(e.g. the tokenizer's <extra_id_k> ids)")
        if len(set(self.sentinel_ids)) != len(self.sentinel_ids):
            raise ValueError("sentinel_ids must be distinct")
        if self.decoder_seq_length is not None and self.decoder_seq_length < self.decoder_length:
            raise ValueError(f"decoder_seq_length {self.decoder_seq_length} is below the {self.decoder_length} "
                             f"targets of encoder_seq_length {self.encoder_seq_length}; raise it or leave it None")


class T5Dataset:
    """Span-corrupted samples from a range of documents of a corpus (document or sentence datasets).

    Documents of the range are concatenated in shuffled order (the T5 paper's packing) and cut
    into samples of ``raw_length`` tokens with the GPT index builders (documents, not sentences, are
    shuffled, so sentence order inside a document is kept). ``ds[i]`` is a dict of numpy arrays
    (E = ``encoder_seq_length``, D = ``decoder_seq_length or decoder_length``):

    * ``text_enc`` int64 (E,): raw tokens with each noise span replaced by its sentinel, then EOS
      (exactly E tokens: ``random_spans_helper`` chooses ``raw_length`` so; never padded);
    * ``text_dec`` int64 (D,): decoder input, ``decoder_start_id`` then the targets shifted right;
    * ``labels`` int64 (D,): targets (for span k: ``sentinel_ids[k]`` then its tokens; then EOS),
      -100 on padding;
    * ``loss_mask`` float32 (D,): 1 on targets; ``enc_mask`` / ``dec_mask`` int64 (E,) / (D,):
      1 on real tokens, 0 on padding.

    Args:
        indexed: the corpus; a document's sequences must lie back to back in ``.bin`` (as every
            builder writes them).
        document_range: ``[start, end)`` of the documents this split uses.
        num_samples: samples needed (None: one epoch); ``len(ds)`` covers whole epochs.
        config: the dataset options.
        name: split name used in cache file names.

    Raises:
        ValueError: the range holds too few tokens, or a document's sequences are not contiguous.
    """

    def __init__(self, indexed: IndexedDataset, document_range: tuple[int, int], num_samples: int | None,
                 config: T5DatasetConfig, name: str = "train") -> None:
        self.indexed, self.config, self.name = indexed, config, name
        d0, d1 = document_range
        di = np.asarray(indexed.document_indices)
        s0, s1 = int(di[d0]), int(di[d1])
        lengths = np.asarray(indexed.sequence_lengths[s0:s1]).astype(np.int64)
        pointers = np.asarray(indexed.sequence_pointers[s0:s1])
        itemsize = indexed.dtype.itemsize
        within = np.ones(max(s1 - s0 - 1, 0), dtype=bool)
        within[(di[d0 + 1:d1] - s0 - 1)[(di[d0 + 1:d1] > s0) & (di[d0 + 1:d1] < s1)]] = False
        if not np.array_equal(np.diff(pointers)[within], (lengths[:-1] * itemsize)[within]):
            raise ValueError(f"{indexed.prefix}: the sequences of a document are not stored back to back; "
                             "rebuild the dataset with IndexedDatasetBuilder")
        cum = np.concatenate(([0], np.cumsum(lengths)))
        doc_lengths = cum[di[d0 + 1:d1 + 1] - s0] - cum[di[d0:d1] - s0]
        key = fingerprint(_INDEX_VERSION, doc_lengths, d0, config.raw_length, config.seed, num_samples,
                          config.shuffle, config.separate_final_epoch_threshold)
        stem = f"t5-{os.path.basename(indexed.prefix)}-{name}"

        def build() -> dict[str, np.ndarray]:
            try:
                # seq_length = raw_length: samples of raw_length + 1 tokens overlapping by one, of which
                # the last is dropped, so consecutive samples share no token
                return build_gpt_indices(doc_lengths, d0, config.raw_length, num_samples, config.seed,
                                         config.shuffle, config.separate_final_epoch_threshold)
            except ValueError as e:
                raise ValueError(f"{indexed.prefix} ({name} split, documents {d0}..{d1}): {e}") from None

        arrays, self.built_index = cached_arrays(
            config.cache_dir, stem, key, _ARRAYS, build,
            {"prefix": indexed.prefix, "split": name, "documents": [d0, d1], "num_samples": num_samples,
             "raw_length": config.raw_length, "seed": config.seed})
        self.document_index = np.asarray(arrays["document_index"])
        self.sample_index = np.asarray(arrays["sample_index"])
        self.shuffle_index = np.asarray(arrays["shuffle_index"])
        self.cache_key = key
        self._cache_base = os.path.join(config.cache_dir, f"{stem}-{key}") if config.cache_dir else None

    def __getstate__(self) -> dict[str, Any]:
        # With a cache, pickle paths rather than arrays (spawned DataLoader workers re-map the files).
        state = self.__dict__.copy()
        if self._cache_base is not None:
            for n in _ARRAYS:
                state[n] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._cache_base is not None:
            for n in _ARRAYS:
                setattr(self, n, np.asarray(np.load(f"{self._cache_base}-{n}.npy", mmap_mode="r")))

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def sample_tokens(self, i: int) -> np.ndarray:
        """The ``raw_length`` tokens of unshuffled sample ``i`` (int64)."""
        j0, o0, j1, o1 = self.sample_index[i:i + 2].ravel().tolist()
        docs = self.document_index[j0:j1 + 1]
        ix = self.indexed
        di = ix.document_indices
        first, last = di[docs], di[docs + 1]
        starts = ix.sequence_pointers[np.minimum(first, len(ix) - 1)] // ix.dtype.itemsize
        ends = np.where(last > first, ix.sequence_pointers[np.maximum(last - 1, 0)] // ix.dtype.itemsize
                        + ix.sequence_lengths[np.maximum(last - 1, 0)], starts)
        tokens = ix.tokens
        pieces = []
        for k, (a, b) in enumerate(zip(starts.tolist(), ends.tolist())):
            lo = a + (o0 if k == 0 else 0)
            hi = a + o1 + 1 if k == len(docs) - 1 else b
            pieces.append(tokens[lo:hi])
        return np.concatenate(pieces).astype(np.int64)[:self.config.raw_length]

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        """Sample ``idx`` of the shuffled order (see the class docstring for the keys)."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range [0, {len(self)}) of {self.name} split")
        cfg = self.config
        raw = self.sample_tokens(int(self.shuffle_index[idx]))
        rng = np.random.default_rng((cfg.seed, idx))
        enc, targets = span_corrupt(raw, rng, sentinel_ids=cfg.sentinel_ids, eos_id=cfg.eos_id,
                                    noise_density=cfg.noise_density,
                                    mean_noise_span_length=cfg.mean_noise_span_length)
        e_len = cfg.encoder_seq_length
        d_len = cfg.decoder_seq_length or cfg.decoder_length
        start = cfg.pad_id if cfg.decoder_start_id is None else cfg.decoder_start_id
        text_enc = np.full(e_len, cfg.pad_id, dtype=np.int64)
        text_enc[:len(enc)] = enc
        text_dec = np.full(d_len, cfg.pad_id, dtype=np.int64)
        text_dec[0] = start
        text_dec[1:len(targets)] = targets[:-1]
        labels = np.full(d_len, IGNORE_INDEX, dtype=np.int64)
        labels[:len(targets)] = targets
        enc_mask = np.zeros(e_len, dtype=np.int64)
        enc_mask[:len(enc)] = 1
        dec_mask = np.zeros(d_len, dtype=np.int64)
        dec_mask[:len(targets)] = 1
        return {"text_enc": text_enc, "text_dec": text_dec, "labels": labels,
                "loss_mask": dec_mask.astype(np.float32), "enc_mask": enc_mask, "dec_mask": dec_mask}


def build_t5_datasets(config: T5DatasetConfig, blend: Sequence[str | float] | None = None,
                      num_samples: Sequence[int | None] = (None, None, None), *,
                      blend_per_split: Sequence[Sequence[str | float] | None] | None = None
                      ) -> list[T5Dataset | BlendedDataset | None]:
    """Train/valid/test T5 datasets, split and blended exactly as ``build_gpt_datasets``.

    Args:
        config: dataset options.
        blend: ``[prefix]`` or ``[w1, prefix1, w2, prefix2, ...]`` (document or sentence datasets).
        num_samples: samples needed per split (None: one epoch of each component).
        blend_per_split: three blends (or None entries) used whole, without ``config.split``.

    Returns:
        Three datasets (None for a split with zero weight or no blend).

    Raises:
        ValueError: both or neither blend given, a blend without num_samples, a split without
        documents in a blend, or a split with fewer than ``raw_length + 1`` tokens.
    """
    return build_split_datasets(config, lambda ds, rng, n, name: T5Dataset(ds, rng, n, config, name),
                                blend, num_samples, blend_per_split)
