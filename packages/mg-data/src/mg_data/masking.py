"""Masking helpers shared by the BERT and T5 datasets: masked-LM selection and T5 span corruption.

Everything here is a pure function of its inputs and a ``numpy.random.Generator``, so a sample is
fixed by the generator's seed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

IGNORE_INDEX = -100
"""Label of positions that carry no loss (``torch.nn.functional.cross_entropy``'s default ``ignore_index``)."""


def word_start_table(is_word_start: Callable[[int], bool] | None, vocab_size: int) -> np.ndarray | None:
    """``is_word_start`` evaluated once for every id, as a bool array of shape (vocab_size,).

    For SentencePiece, ``lambda i: sp.id_to_piece(i).startswith("▁")`` marks word starts; pieces
    without the leading ``▁`` continue the previous word. None (no whole-word masking) stays None.
    """
    if is_word_start is None:
        return None
    return np.fromiter((bool(is_word_start(i)) for i in range(vocab_size)), dtype=bool, count=vocab_size)


def mask_tokens(tokens: np.ndarray, rng: np.random.Generator, *, vocab_size: int, mask_id: int,
                special_ids: Sequence[int], masked_lm_prob: float = 0.15, max_predictions: int | None = None,
                word_starts: np.ndarray | None = None, mask_prob: float = 0.8,
                random_prob: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """BERT masked-LM corruption of one sequence.

    Candidates are the tokens not in ``special_ids``; they are grouped into words (with
    ``word_starts``, a token whose id is not a word start joins the previous candidate's word;
    without it every token is its own word). Words are visited in random order and taken whole
    while the count of chosen tokens stays within ``round(masked_lm_prob * candidates)`` (at least
    1, at most ``max_predictions``). Each chosen token becomes ``mask_id`` with probability
    ``mask_prob``, a uniform random id in ``[0, vocab_size)`` with ``random_prob``, else stays.

    Args:
        tokens: int ids, shape (S,).
        rng: the sample's generator.
        word_starts: bool table over ids (``word_start_table``) for whole-word masking, or None.

    Returns:
        (corrupted tokens int64 (S,), labels int64 (S,): the original id at chosen positions,
        ``IGNORE_INDEX`` elsewhere).
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    out = tokens.copy()
    labels = np.full(len(tokens), IGNORE_INDEX, dtype=np.int64)
    cand = ~np.isin(tokens, np.asarray(list(special_ids), dtype=np.int64))
    pos = np.flatnonzero(cand)
    if len(pos) == 0:
        return out, labels
    num_to_predict = max(1, int(round(len(pos) * masked_lm_prob)))
    if max_predictions is not None:
        num_to_predict = min(num_to_predict, max_predictions)
    if word_starts is None:
        chosen = rng.permutation(pos)[:num_to_predict]
    else:
        starts = word_starts[tokens[pos]].copy()
        # a word never continues across a special token (or the start of the sequence)
        starts[0] = True
        starts[1:] |= np.diff(pos) != 1
        word_id = np.cumsum(starts) - 1
        bounds = np.flatnonzero(np.concatenate((starts, [True])))
        sizes = np.diff(bounds)
        picked: list[int] = []
        count = 0
        for w in rng.permutation(len(sizes)).tolist():
            if count >= num_to_predict:
                break
            if count + sizes[w] > num_to_predict:
                continue  # too long to fit: a shorter word may still fill the budget
            picked.append(w)
            count += int(sizes[w])
        chosen = pos[np.isin(word_id, picked)] if picked else pos[:0]
    labels[chosen] = tokens[chosen]
    r = rng.random(len(chosen))
    out[chosen[r < mask_prob]] = mask_id
    rand_at = chosen[(r >= mask_prob) & (r < mask_prob + random_prob)]
    out[rand_at] = rng.integers(0, vocab_size, size=len(rand_at))
    return out, labels


def _span_counts(length: int, noise_density: float, mean_noise_span_length: float) -> tuple[int, int]:
    """(noise tokens, noise spans) of a ``length``-token sequence, rounded as the T5 paper's code does."""
    num_noise = int(round(length * noise_density))
    num_spans = int(round(num_noise / mean_noise_span_length))
    return num_noise, num_spans


def random_spans_helper(inputs_length: int, noise_density: float = 0.15, mean_noise_span_length: float = 3.0
                        ) -> tuple[int, int]:
    """Raw tokens to read and decoder length for an encoder length of ``inputs_length`` (T5 paper).

    The raw length is the largest ``n`` whose corrupted form (non-noise tokens, one sentinel per
    noise span and one end-of-sequence token) fits in ``inputs_length``; the decoder length is
    noise tokens + one sentinel per span + end-of-sequence. One more raw token lengthens the
    corrupted form by at most one (a new span needs a new noise token, which leaves the non-noise
    count unchanged), so the corrupted form is exactly ``inputs_length`` long.

    Returns:
        (raw tokens per sample, decoder targets length).

    Raises:
        ValueError: ``inputs_length`` too small for one noise span.
    """
    if not 0 < noise_density < 1 or mean_noise_span_length < 1:
        raise ValueError(f"noise_density must be in (0, 1) and mean_noise_span_length >= 1, got "
                         f"{noise_density}, {mean_noise_span_length}")

    def lengths(n: int) -> tuple[int, int]:
        noise, spans = _span_counts(n, noise_density, mean_noise_span_length)
        return n - noise + spans + 1, noise + spans + 1

    n = inputs_length - 1
    while lengths(n + 1)[0] <= inputs_length:
        n += 1
    noise, spans = _span_counts(n, noise_density, mean_noise_span_length)
    if noise < 1 or spans < 1 or n - noise < 1:
        raise ValueError(f"encoder length {inputs_length} is too short for span corruption with noise density "
                         f"{noise_density} and mean span length {mean_noise_span_length}; use a longer one")
    return n, lengths(n)[1]


def _random_segmentation(num_items: int, num_segments: int, rng: np.random.Generator) -> np.ndarray:
    """Lengths of a uniformly random split of ``num_items`` into ``num_segments`` non-empty runs."""
    cuts = np.sort(rng.choice(num_items - 1, size=num_segments - 1, replace=False)) + 1
    return np.diff(np.concatenate(([0], cuts, [num_items])))


def noise_span_lengths(length: int, rng: np.random.Generator, noise_density: float = 0.15,
                       mean_noise_span_length: float = 3.0) -> tuple[np.ndarray, np.ndarray]:
    """(non-noise run lengths, noise run lengths), K each; the sequence is non-noise, noise, non-noise, ...

    Noise tokens and spans are counted as in ``random_spans_helper``, so the corrupted lengths match
    its formula exactly.
    """
    num_noise, num_spans = _span_counts(length, noise_density, mean_noise_span_length)
    num_noise = min(max(num_noise, 1), length - 1)
    num_spans = min(max(num_spans, 1), num_noise, length - num_noise)
    return (_random_segmentation(length - num_noise, num_spans, rng),
            _random_segmentation(num_noise, num_spans, rng))


def span_corrupt(tokens: np.ndarray, rng: np.random.Generator, *, sentinel_ids: Sequence[int], eos_id: int,
                 noise_density: float = 0.15, mean_noise_span_length: float = 3.0) -> tuple[np.ndarray, np.ndarray]:
    """T5 span corruption of ``tokens`` (shape (N,)).

    Noise span ``k`` is replaced by ``sentinel_ids[k]`` in the encoder input; the targets are, for
    each span in order, ``sentinel_ids[k]`` followed by the span's tokens. Both end with ``eos_id``.

    Returns:
        (encoder input int64, targets int64), of the lengths ``random_spans_helper`` gives for N.

    Raises:
        ValueError: more noise spans than sentinel ids.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    keep, noise = noise_span_lengths(len(tokens), rng, noise_density, mean_noise_span_length)
    k = len(keep)
    if k > len(sentinel_ids):
        raise ValueError(f"{k} noise spans need {k} sentinel ids, got {len(sentinel_ids)}; pass more sentinel_ids")
    sentinels = np.asarray(sentinel_ids[:k], dtype=np.int64)
    bounds = np.concatenate(([0], np.cumsum(np.stack([keep, noise], axis=1).ravel())))
    enc: list[np.ndarray] = []
    dec: list[np.ndarray] = []
    for j in range(k):
        enc += [tokens[bounds[2 * j]:bounds[2 * j + 1]], sentinels[j:j + 1]]
        dec += [sentinels[j:j + 1], tokens[bounds[2 * j + 1]:bounds[2 * j + 2]]]
    eos = np.asarray([eos_id], dtype=np.int64)
    return np.concatenate(enc + [eos]), np.concatenate(dec + [eos])
