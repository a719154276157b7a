"""BERT sample datasets: sentence pairs from a sentence-split corpus, masked-LM and sentence targets."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from mg_data.blended import BlendedDataset
from mg_data.gpt_dataset import build_split_datasets
from mg_data.gpt_indices import parse_split
from mg_data.index_cache import cached_arrays, fingerprint
from mg_data.indexed import IndexedDataset
from mg_data.masking import IGNORE_INDEX, mask_tokens, word_start_table

_INDEX_VERSION = 1
SENTENCE_TASKS = ("sop", "nsp", "none")


class NotSentenceSplitError(ValueError):
    """No document holds the sentences a sample needs: the dataset is not split into sentences."""


@dataclass(kw_only=True)
class BertDatasetConfig:
    """How BERT samples are grouped, paired, truncated, masked, split and cached."""

    max_seq_length: int
    """Tokens per sample, [CLS] and the two [SEP] included; shorter samples are padded."""
    vocab_size: int
    """Ids drawn for the "random token" replacement are uniform in [0, vocab_size)."""
    cls_id: int
    """Id of [CLS] (first token)."""
    sep_id: int
    """Id of [SEP] (ends each segment)."""
    mask_id: int
    """Id of [MASK]."""
    pad_id: int
    """Id written into padding positions."""
    seed: int = 1234
    """Seed of sample grouping and shuffling; sample i also draws from a generator seeded by (seed, i)."""
    split: str = "969,30,1"
    """Train/valid/test weights over documents (contiguous document ranges)."""
    cache_dir: str | None = None
    """Directory of cached index files; None builds them in memory every time."""
    shuffle: bool = True
    """False serves samples in corpus order (debugging)."""
    sentence_task: Literal["sop", "nsp", "none"] = "sop"
    """``sop``: with probability 0.5 swap A and B (sentence order); ``nsp``: with probability 0.5 B
    comes from a random other document (next sentence); ``none``: one segment, no sentence target."""
    short_seq_prob: float = 0.1
    """Probability that a sample aims at a random shorter length in [2, max_seq_length - 3]."""
    masked_lm_prob: float = 0.15
    """Share of non-special tokens chosen for prediction."""
    mask_prob: float = 0.8
    """Share of chosen tokens replaced by [MASK]."""
    random_prob: float = 0.1
    """Share of chosen tokens replaced by a random id (the rest stay unchanged)."""
    is_word_start: Callable[[int], bool] | None = None
    """Whole-word masking when set: False for ids continuing the previous word (SentencePiece:
    pieces not starting with "▁"). Evaluated once over the vocabulary here."""
    word_starts: np.ndarray | None = field(default=None, repr=False, compare=False)
    """Bool table over ids computed from ``is_word_start`` (or given directly instead of it)."""

    def __post_init__(self) -> None:
        if self.max_seq_length < 5:
            raise ValueError(f"max_seq_length must be >= 5, got {self.max_seq_length}")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")
        for name in ("cls_id", "sep_id", "mask_id", "pad_id"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or not 0 <= v < self.vocab_size:
                raise ValueError(f"{name} must be an id in [0, vocab_size={self.vocab_size}), got {v!r}; "
                                 "take it from the tokenizer (see the mg-data README)")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        parse_split(self.split)
        if self.sentence_task not in SENTENCE_TASKS:
            raise ValueError(f"sentence_task must be one of {SENTENCE_TASKS}, got {self.sentence_task!r}")
        for name in ("short_seq_prob", "masked_lm_prob", "mask_prob", "random_prob"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.mask_prob + self.random_prob > 1:
            raise ValueError(f"mask_prob + random_prob must be <= 1, got {self.mask_prob + self.random_prob}")
        if self.word_starts is None:
            self.word_starts = word_start_table(self.is_word_start, self.vocab_size)
        elif len(self.word_starts) != self.vocab_size:
            raise ValueError(f"word_starts has {len(self.word_starts)} entries; it needs vocab_size={self.vocab_size}")

    def __getstate__(self) -> dict[str, Any]:
        # the callable (often a lambda) may not pickle; the table it produced is all samples need
        return {**self.__dict__, "is_word_start": None}

    @property
    def max_num_tokens(self) -> int:
        """Tokens left for the segments: max_seq_length minus [CLS] and the [SEP]s."""
        return self.max_seq_length - (2 if self.sentence_task == "none" else 3)

    @property
    def min_sentences(self) -> int:
        """Sentences a sample needs: two for a sentence target, else one."""
        return 1 if self.sentence_task == "none" else 2


def build_bert_samples(sentence_lengths: np.ndarray, document_bounds: np.ndarray, first_sentence: int,
                       max_num_tokens: int, short_seq_prob: float, min_sentences: int, num_samples: int | None,
                       seed: int, shuffle: bool = True) -> np.ndarray:
    """Runs of consecutive sentences of one document, one row per sample (Megatron's samples mapping).

    Each document is cut greedily: a run grows until it holds ``target`` tokens (``max_num_tokens``,
    or with probability ``short_seq_prob`` a random length in [2, max_num_tokens]) or the document
    ends; every run has at least ``min_sentences`` sentences and a shorter tail joins the run before
    it. Documents with fewer than ``min_sentences`` sentences are left out. Epochs (fresh targets
    each) are added until there are ``num_samples`` rows (one epoch when None), then all rows are
    shuffled together.

    Args:
        sentence_lengths: tokens of each sentence of the split, shape (N,).
        document_bounds: first sentence of each document relative to the split, then N; shape (D+1,).
        first_sentence: id of the split's first sentence in the indexed dataset.

    Returns:
        int64 array (K, 3): first sentence id, end sentence id (exclusive), target length.

    Raises:
        NotSentenceSplitError: no document has ``min_sentences`` sentences.
    """
    rng = np.random.default_rng(seed)
    cum = np.concatenate(([0], np.cumsum(sentence_lengths, dtype=np.int64)))
    bounds = np.asarray(document_bounds, dtype=np.int64)
    usable = (bounds[1:] - bounds[:-1]) >= min_sentences
    if not usable.any():
        raise NotSentenceSplitError(f"no document holds {min_sentences} sentences; BERT needs a sentence-split "
                                    "dataset (preprocess with split_sentences=True)")
    epochs: list[np.ndarray] = []
    total = 0
    while not epochs or (num_samples is not None and total < num_samples):
        s, end = bounds[:-1][usable], bounds[1:][usable]
        rows = []
        while len(s):
            target = np.full(len(s), max_num_tokens, dtype=np.int64)
            short = rng.random(len(s)) < short_seq_prob
            target[short] = rng.integers(2, max_num_tokens + 1, size=int(short.sum()))
            e = np.searchsorted(cum, cum[s] + target, side="left")
            e = np.minimum(np.maximum(e, s + min_sentences), end)
            e = np.where(end - e < min_sentences, end, e)  # a too-short tail joins this run
            rows.append(np.stack([s, e, target], axis=1))
            more = e < end
            s, end = e[more], end[more]
        epoch = np.concatenate(rows)
        epochs.append(epoch[np.lexsort((epoch[:, 0],))])  # corpus order within the epoch
        total += len(epoch)
    samples = np.concatenate(epochs)
    samples[:, :2] += first_sentence
    if shuffle:
        samples = samples[rng.permutation(len(samples))]
    return samples


def truncate_pair(len_a: int, len_b: int, max_tokens: int) -> tuple[int, int]:
    """Lengths after repeatedly dropping a token from the longer segment (B on ties) until they fit."""
    if len_a + len_b <= max_tokens:
        return len_a, len_b
    short = min(len_a, len_b)
    if 2 * short <= max_tokens:
        kept = (short, max_tokens - short)
        return kept if len_a <= len_b else kept[::-1]
    return (max_tokens + 1) // 2, max_tokens // 2


class BertDataset:
    """Masked-LM samples with a sentence-order or next-sentence target from a sentence-split corpus.

    ``ds[i]`` is a dict of numpy arrays (S = ``max_seq_length``): ``text`` int64 (S,)
    ``[CLS] A [SEP] B [SEP]`` then padding, masked; ``types`` int64 (S,) 0 on [CLS] A [SEP], 1 on
    B [SEP] (0 on padding); ``labels`` int64 (S,) the original id where a token was chosen, -100
    elsewhere (``F.cross_entropy``'s ignore_index); ``loss_mask`` float32 (S,) 1 where chosen;
    ``padding_mask`` int64 (S,) 1 on real tokens, 0 on padding; ``is_random`` int64 () 1 when the
    segments were swapped (SOP) or B is from another document (NSP); ``truncated`` int64 () 1 when
    tokens were cut. Sample ``i`` depends only on the corpus, the config and ``i``.

    Args:
        indexed: a sentence-split corpus (one sequence per sentence, documents from its document index).
        document_range: ``[start, end)`` of the documents this split uses.
        num_samples: samples needed (None: one epoch); ``len(ds)`` covers whole epochs.
        config: the dataset options.
        name: split name used in cache file names.

    Raises:
        ValueError: no document of the range has enough sentences.
    """

    def __init__(self, indexed: IndexedDataset, document_range: tuple[int, int], num_samples: int | None,
                 config: BertDatasetConfig, name: str = "train") -> None:
        self.indexed, self.config, self.name = indexed, config, name
        d0, d1 = document_range
        self.document_range = (d0, d1)
        di = np.asarray(indexed.document_indices)
        s0, s1 = int(di[d0]), int(di[d1])
        lengths = np.asarray(indexed.sequence_lengths[s0:s1])
        bounds = di[d0:d1 + 1] - s0
        key = fingerprint(_INDEX_VERSION, lengths, bounds, s0, config.max_num_tokens, config.short_seq_prob,
                          config.min_sentences, num_samples, config.seed, config.shuffle)
        stem = f"bert-{os.path.basename(indexed.prefix)}-{name}"

        def build() -> dict[str, np.ndarray]:
            try:
                return {"samples": build_bert_samples(lengths, bounds, s0, config.max_num_tokens,
                                                      config.short_seq_prob, config.min_sentences, num_samples,
                                                      config.seed, config.shuffle)}
            except ValueError as e:  # the same error class, with the file and split it is about
                raise type(e)(f"{indexed.prefix} ({name} split, documents {d0}..{d1}): {e}") from None

        arrays, self.built_index = cached_arrays(
            config.cache_dir, stem, key, ("samples",), build,
            {"prefix": indexed.prefix, "split": name, "documents": [d0, d1], "num_samples": num_samples,
             "max_seq_length": config.max_seq_length, "seed": config.seed})
        self.samples = np.asarray(arrays["samples"])
        self.cache_key = key
        self._cache_base = os.path.join(config.cache_dir, f"{stem}-{key}") if config.cache_dir else None
        if config.sentence_task == "nsp" and d1 - d0 < 2:
            raise ValueError(f"{indexed.prefix} ({name} split): sentence_task='nsp' needs at least two documents")

    def __getstate__(self) -> dict[str, Any]:
        # With a cache, pickle the path rather than the array (spawned DataLoader workers re-map it).
        state = self.__dict__.copy()
        if self._cache_base is not None:
            state["samples"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._cache_base is not None:
            self.samples = np.asarray(np.load(f"{self._cache_base}-samples.npy", mmap_mode="r"))

    def __len__(self) -> int:
        return len(self.samples)

    def _random_segment(self, rng: np.random.Generator, sentence: int, want: int) -> list[np.ndarray] | None:
        """Sentences of a random other document of the split, from a random start, about ``want`` tokens."""
        di = self.indexed.document_indices
        d0, d1 = self.document_range
        own = int(np.searchsorted(di, sentence, side="right")) - 1
        for _ in range(10):  # a few tries past empty documents
            d = int(rng.integers(d0, d1 - 1))
            d += d >= own
            a, b = int(di[d]), int(di[d + 1])
            if b > a:
                break
        else:
            return None
        out, n = [], 0
        for k in range(int(rng.integers(a, b)), b):
            out.append(self.indexed[k])
            n += len(out[-1])
            if n >= want:
                break
        return out

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        """Sample ``idx`` (see the class docstring for the keys)."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range [0, {len(self)}) of {self.name} split")
        cfg = self.config
        rng = np.random.default_rng((cfg.seed, idx))
        s, e, target = (int(x) for x in self.samples[idx])
        sentences = [self.indexed[k] for k in range(s, e)]
        is_random = 0
        if cfg.sentence_task == "none":
            seg_a, seg_b = sentences, []
        else:
            a_end = 1 if len(sentences) < 3 else int(rng.integers(1, len(sentences)))
            seg_a, seg_b = sentences[:a_end], sentences[a_end:]
            if rng.random() < 0.5:
                if cfg.sentence_task == "sop":
                    seg_a, seg_b, is_random = seg_b, seg_a, 1
                else:
                    len_a = sum(len(x) for x in seg_a)
                    other = self._random_segment(rng, s, max(1, target - len_a))
                    if other is not None:
                        seg_b, is_random = other, 1
        a = np.concatenate(seg_a).astype(np.int64)
        b = np.concatenate(seg_b).astype(np.int64) if seg_b else np.zeros(0, np.int64)
        keep_a, keep_b = truncate_pair(len(a), len(b), cfg.max_num_tokens)
        truncated = int(keep_a < len(a) or keep_b < len(b))
        # each dropped token came off the front or the back with probability 0.5
        front_a = int(rng.binomial(len(a) - keep_a, 0.5))
        front_b = int(rng.binomial(len(b) - keep_b, 0.5))
        a, b = a[front_a:front_a + keep_a], b[front_b:front_b + keep_b]
        cls, sep = np.asarray([cfg.cls_id]), np.asarray([cfg.sep_id])
        parts = [cls, a, sep] + ([b, sep] if cfg.sentence_task != "none" else [])
        tokens = np.concatenate(parts).astype(np.int64)
        n = len(tokens)
        types = np.zeros(cfg.max_seq_length, dtype=np.int64)
        types[len(a) + 2:n] = 1
        max_predictions = max(1, int(round(cfg.masked_lm_prob * cfg.max_num_tokens)))
        masked, labels = mask_tokens(tokens, rng, vocab_size=cfg.vocab_size, mask_id=cfg.mask_id,
                                     special_ids=(cfg.cls_id, cfg.sep_id), masked_lm_prob=cfg.masked_lm_prob,
                                     max_predictions=max_predictions, word_starts=cfg.word_starts,
                                     mask_prob=cfg.mask_prob, random_prob=cfg.random_prob)
        pad = cfg.max_seq_length - n
        text = np.concatenate([masked, np.full(pad, cfg.pad_id, dtype=np.int64)])
        labels = np.concatenate([labels, np.full(pad, IGNORE_INDEX, dtype=np.int64)])
        padding_mask = np.zeros(cfg.max_seq_length, dtype=np.int64)
        padding_mask[:n] = 1
        return {"text": text, "types": types, "labels": labels, "is_random": np.int64(is_random),
                "loss_mask": (labels != IGNORE_INDEX).astype(np.float32), "padding_mask": padding_mask,
                "truncated": np.int64(truncated)}


def build_bert_datasets(config: BertDatasetConfig, blend: Sequence[str | float] | None = None,
                        num_samples: Sequence[int | None] = (None, None, None), *,
                        blend_per_split: Sequence[Sequence[str | float] | None] | None = None
                        ) -> list[BertDataset | BlendedDataset | None]:
    """Train/valid/test BERT datasets, split and blended exactly as ``build_gpt_datasets``.

    Args:
        config: dataset options.
        blend: ``[prefix]`` or ``[w1, prefix1, w2, prefix2, ...]`` of sentence-split datasets
            (``..._sentence``); each prefix is split by documents.
        num_samples: samples needed per split (None: one epoch of each component).
        blend_per_split: three blends (or None entries) used whole, without ``config.split``.

    Returns:
        Three datasets (None for a split with zero weight or no blend).

    Raises:
        ValueError: both or neither blend given, a blend without num_samples, a split without
        documents in a blend, or no document with enough sentences.
    """
    return build_split_datasets(config, lambda ds, rng, n, name: BertDataset(ds, rng, n, config, name),
                                blend, num_samples, blend_per_split)
