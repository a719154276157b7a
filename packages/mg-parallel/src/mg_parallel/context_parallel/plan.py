"""Which (query block, key block) pairs each step of blockwise attention computes, and their masks.

Blockwise attention (ring and all-gather) visits the K/V of every rank ``src`` once; step ``i``
holds ``src = (r - i) mod cp``. With the load-balanced layout (rank ``r`` holds chunks ``r`` and
``2cp-1-r``, each of ``c`` tokens) the causal structure of a step is:

* ``src == r``: the local ``2c x 2c`` block, lower-triangular (causal diagonal);
* ``src < r``: every query against the first ``c`` keys (chunk ``src``), unmasked;
* ``src > r``: the last ``c`` queries (chunk ``2cp-1-r``) against all ``2c`` keys, unmasked;

so every step costs ``2c^2`` scores on every rank (the diagonal step half-masked). A sliding window
cuts blocks into chunk pairs (and a pair much longer than the window into tiles along its band), skips
pairs the window leaves empty and masks the pairs it cuts;
document ids mask every block. Which pairs are full, empty or cut follows from the chunks'
positions alone (no tensor is looked at); a block's boolean mask is built on the device only when
its kernel runs (and again in backward), so no ``s x s/cp`` mask is kept.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mg_parallel.context_parallel.chunking import cp_position_ids
from mg_parallel.context_parallel.masks import attention_mask

__all__ = ["Block", "build_plan", "step_blocks"]

Block = tuple[slice, slice, str, "Callable[[], torch.Tensor] | None", tuple[torch.Tensor, torch.Tensor]]
"""``(query slice, key slice, kind, mask builder, (query positions, key positions))``: slices of the local
sequence; kind ``"full"``, ``"causal"`` or ``"masked"``; for ``"masked"``, a function returning the
``[1 or b, sq, sk]`` mask; the global positions of the block's queries and keys (attention dropout hashes
them)."""


def _classify(q_start: int, k_start: int, c: int, causal: bool, window: int | None) -> str | None:
    # Kind of the pair of chunks starting at global positions q_start, k_start; None when empty.
    lo, hi = q_start - k_start - (c - 1), q_start - k_start + (c - 1)  # range of i - j over the pair
    w = float("inf") if window is None else window
    if causal:
        if hi < 0 or lo >= w:
            return None
        if lo >= 0 and hi < w:
            return "full"
        return "causal" if q_start == k_start and c - 1 < w else "masked"
    if lo >= w or hi <= -w:
        return None
    return "full" if max(-lo, hi) < w else "masked"


def step_blocks(rank: int, src: int, cp: int, local_len: int, causal: bool, window: int | None) -> list[tuple]:
    """The ``(query slice, key slice, kind)`` blocks of the step that holds ``src``'s K/V."""
    c = local_len // 2
    every, first, second = slice(0, local_len), slice(0, c), slice(c, local_len)
    if window is None:
        if not causal:
            return [(every, every, "full")]
        if src == rank:
            return [(every, every, "causal")]
        return [(every, first, "full")] if src < rank else [(second, every, "full")]
    q_starts, k_starts = (rank * c, (2 * cp - 1 - rank) * c), (src * c, (2 * cp - 1 - src) * c)  # of the chunks
    t = _tile(c, window)
    blocks = []
    for qs, q_start in zip((first, second), q_starts):
        for ks, k_start in zip((first, second), k_starts):
            for qo, ko, kind in _band(q_start, k_start, c, t, causal, window):
                blocks.append((slice(qs.start + qo, qs.start + qo + t), slice(ks.start + ko, ks.start + ko + t), kind))
    return blocks


MIN_TILE = 128
"""Smallest tile a sliding window cuts a chunk pair into (see :func:`_tile`)."""


def _tile(c: int, window: int) -> int:
    # A chunk pair much longer than the window is cut into square tiles, the smallest divisor of c that is at least
    # max(window, MIN_TILE), so only tiles along the window's band are computed (a whole chunk pair otherwise).
    for t in range(max(window, MIN_TILE), c // 2 + 1):
        if c % t == 0:
            return t
    return c


def _band(q_start: int, k_start: int, c: int, t: int, causal: bool, window: int) -> list[tuple[int, int, str]]:
    # The non-empty (query offset, key offset, kind) tiles of side t of the chunk pair at global q_start, k_start:
    # a key tile at b meets a query tile at a only if b lies within the window's reach of a (i - j in [0, w) causal,
    # (-w, w) otherwise).
    tiles = []
    for qo in range(0, c, t):
        a = q_start + qo
        lo = a - (t - 1) - (window - 1) - k_start
        hi = a + (t - 1) + (0 if causal else window - 1) - k_start
        for ko in range(max(0, -(-lo // t)) * t, min(c - t, hi) + 1, t):
            kind = _classify(a, k_start + ko, t, causal, window)
            if kind is not None:
                tiles.append((qo, ko, kind))
    return tiles


def build_plan(rank: int, cp: int, local_len: int, causal: bool, window: int | None, q_doc: torch.Tensor | None,
               all_docs: torch.Tensor | None, device: torch.device) -> list[list[Block]]:
    """The blocks of every step, ``plan[i]`` for the K/V of ``src = (rank - i) mod cp``.

    ``q_doc [b, s/cp]``: this rank's document ids; ``all_docs [b, s]``: every rank's in rank order
    (both None without documents). With documents every block is ``"masked"``.
    """
    q_pos = cp_position_ids(local_len, rank, cp, device)
    plan = []
    for i in range(cp):
        src = (rank - i) % cp
        k_pos = cp_position_ids(local_len, src, cp, device)
        k_doc = None if all_docs is None else all_docs[:, src * local_len : (src + 1) * local_len]
        step = []
        for qs, ks, kind in step_blocks(rank, src, cp, local_len, causal, window):
            build = None
            if kind == "masked" or q_doc is not None:
                kind = "masked"
                build = _mask_builder(q_pos[qs], k_pos[ks], causal, window,
                                      None if q_doc is None else q_doc[:, qs], None if k_doc is None else k_doc[:, ks])
            step.append((qs, ks, kind, build, (q_pos[qs], k_pos[ks])))
        plan.append(step)
    return plan


def _mask_builder(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: int | None,
                  q_doc: torch.Tensor | None, k_doc: torch.Tensor | None) -> Callable[[], torch.Tensor]:
    return lambda: attention_mask(q_pos, k_pos, causal=causal, window=window, q_doc=q_doc, k_doc=k_doc)
