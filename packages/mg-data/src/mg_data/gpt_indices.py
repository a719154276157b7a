"""Vectorised builders of the three GPT sample indices (no compiled helper).

* document index: the sequence ids of a split, one shuffled copy per epoch (the epochs before a
  short final epoch are shuffled together and the final epoch apart, as Megatron does);
* sample index: for sample ``i``, the (document-index position, token offset) where it starts;
  row ``i + 1`` is where it ends (its last token included), so it has ``num_samples + 1`` rows;
* shuffle index: the order in which samples are served.
"""

from __future__ import annotations

import numpy as np

# Megatron shuffles a final epoch apart when it contributes less than this share of an epoch.
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` (or ``"98/2/0"``) as three normalised weights.

    Raises:
        ValueError: not one to three non-negative numbers with a positive sum.
    """
    try:
        w = [float(x) for x in split.replace("/", ",").split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"split {split!r} must be comma-separated numbers such as '969,30,1'") from None
    if not 1 <= len(w) <= 3 or any(x < 0 for x in w) or sum(w) <= 0:
        raise ValueError(f"split {split!r} needs one to three non-negative weights with a positive sum")
    w += [0.0] * (3 - len(w))
    s = sum(w)
    return [x / s for x in w]


def split_ranges(num_documents: int, weights: list[float]) -> list[tuple[int, int]]:
    """Contiguous document ranges ``[start, end)`` of each split, covering all documents."""
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * num_documents)))
    diff = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    bounds = [min(max(b, 0), num_documents) for b in bounds]
    return [(bounds[i], bounds[i + 1]) for i in range(len(weights))]


def num_epochs_for(tokens_per_epoch: int, seq_length: int, num_samples: int | None) -> int:
    """Fewest epochs giving ``num_samples`` samples of ``seq_length + 1`` tokens (1 when None).

    Raises:
        ValueError: the split has fewer than ``seq_length + 1`` tokens.
    """
    if tokens_per_epoch <= seq_length:
        raise ValueError(f"the split holds {tokens_per_epoch} tokens, fewer than seq_length+1 = "
                         f"{seq_length + 1}; use a larger split weight or a shorter seq_length")
    if num_samples is None:
        return 1
    # samples in E epochs = (E*T - 1) // S >= n  <=>  E*T >= n*S + 1
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def build_document_index(sequence_ids: np.ndarray, num_epochs: int, separate_final: bool,
                         rng: np.random.Generator) -> np.ndarray:
    """``sequence_ids`` repeated ``num_epochs`` times and shuffled (final epoch apart if asked)."""
    dtype = np.int32 if (len(sequence_ids) == 0 or sequence_ids.max() < 2**31) else np.int64
    ids = np.asarray(sequence_ids, dtype=dtype)
    if not separate_final or num_epochs == 1:
        out = np.tile(ids, num_epochs)
        rng.shuffle(out)
        return out
    first = np.tile(ids, num_epochs - 1)
    rng.shuffle(first)
    last = ids.copy()
    rng.shuffle(last)
    return np.concatenate([first, last])


def build_sample_index(lengths_in_order: np.ndarray, seq_length: int, num_samples: int,
                       chunk: int = 1 << 24) -> np.ndarray:
    """Start (and end) points of ``num_samples`` samples over the concatenated documents.

    Args:
        lengths_in_order: tokens of each document-index entry, shape (M,).
        seq_length: tokens per sample minus one (consecutive samples share one token).
        num_samples: rows to build minus one; needs ``num_samples * seq_length < sum(lengths)``.

    Returns:
        (num_samples + 1, 2) array of (document-index position, offset); int32 when it fits.
    """
    cum = np.empty(len(lengths_in_order) + 1, dtype=np.int64)
    cum[0] = 0
    np.cumsum(lengths_in_order, dtype=np.int64, out=cum[1:])
    if num_samples * seq_length >= cum[-1]:
        raise ValueError(f"{num_samples} samples of {seq_length}+1 tokens need more than the {cum[-1]} tokens given")
    small = len(lengths_in_order) < 2**31 and (len(lengths_in_order) == 0 or lengths_in_order.max() < 2**31)
    out = np.empty((num_samples + 1, 2), dtype=np.int32 if small else np.int64)
    for s in range(0, num_samples + 1, chunk):
        pos = np.arange(s, min(s + chunk, num_samples + 1), dtype=np.int64) * seq_length
        # side="right" lands on the last document starting at or before pos, which skips empty ones
        j = np.searchsorted(cum, pos, side="right") - 1
        out[s:s + len(pos), 0] = j
        out[s:s + len(pos), 1] = pos - cum[j]
    return out


def build_shuffle_index(num_samples: int, num_samples_first: int, rng: np.random.Generator) -> np.ndarray:
    """Permutation of ``range(num_samples)``; the first ``num_samples_first`` and the rest shuffled apart."""
    dtype = np.int32 if num_samples < 2**31 else np.int64
    first = np.arange(num_samples_first, dtype=dtype)
    rng.shuffle(first)
    rest = np.arange(num_samples_first, num_samples, dtype=dtype)
    rng.shuffle(rest)
    return np.concatenate([first, rest])


def build_gpt_indices(lengths: np.ndarray, first_sequence: int, seq_length: int, num_samples: int | None,
                      seed: int, shuffle: bool = True,
                      separate_final_epoch_threshold: float = SEPARATE_FINAL_EPOCH_THRESHOLD) -> dict[str, np.ndarray]:
    """All three indices for one split.

    Args:
        lengths: tokens of each sequence of the split, shape (D,).
        first_sequence: id of the split's first sequence in the indexed dataset.
        seq_length: sample length minus one.
        num_samples: samples needed (None: one epoch).
        seed: shuffling seed.
        shuffle: False keeps documents and samples in corpus order.
        separate_final_epoch_threshold: a final epoch contributing fewer than this share of an
            epoch's samples is shuffled apart from the others (0 never separates).

    Returns:
        ``{"document_index", "sample_index", "shuffle_index"}``.
    """
    tokens = int(lengths.sum(dtype=np.int64))
    epochs = num_epochs_for(tokens, seq_length, num_samples)
    per_epoch = (tokens - 1) // seq_length
    separate = False
    sans_final = 0
    if epochs > 1 and num_samples is not None:
        sans_final = ((epochs - 1) * tokens - 1) // seq_length
        separate = (num_samples - sans_final) < int(separate_final_epoch_threshold * per_epoch)
    rng = np.random.default_rng(seed)
    ids = np.arange(first_sequence, first_sequence + len(lengths), dtype=np.int64)
    if shuffle:
        doc = build_document_index(ids, epochs, separate, rng)
    else:
        doc = np.tile(ids.astype(np.int32 if first_sequence + len(lengths) < 2**31 else np.int64), epochs)
    total = (epochs * tokens - 1) // seq_length
    sample = build_sample_index(lengths[doc - first_sequence], seq_length, total)
    if shuffle:
        shuf = build_shuffle_index(total, sans_final if separate else total, rng)
    else:
        shuf = np.arange(total, dtype=np.int32 if total < 2**31 else np.int64)
    return {"document_index": doc, "sample_index": sample, "shuffle_index": shuf}
