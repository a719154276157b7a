"""Which (query block, key block) pairs each step of blockwise attention computes, and their masks.

Blockwise attention (ring and all-gather) visits the K/V of every rank ``src`` once; step ``i``
holds ``src = (r - i) mod cp``. With the load-balanced layout (rank ``r`` holds chunks ``r`` and
``2cp-1-r``, each of ``c`` tokens) the causal structure of a step is:

* ``src == r``: the local ``2c x 2c`` block, lower-triangular (causal diagonal);
* ``src < r``: every query against the first ``c`` keys (chunk ``src``), unmasked;
* ``src > r``: the last ``c`` queries (chunk ``2cp-1-r``) against all ``2c`` keys, unmasked;

so every step costs ``2c^2`` scores on every rank (the diagonal step half-masked). A sliding window
cuts blocks into chunk pairs, skips pairs the window leaves empty and masks the rest; document
ids add a data-dependent mask to every block.
"""

from __future__ import annotations

import torch

from mg_parallel.context_parallel.chunking import cp_position_ids
from mg_parallel.context_parallel.masks import attention_mask

__all__ = ["Block", "build_plan", "step_blocks"]

Block = tuple[slice, slice, str, "torch.Tensor | None"]


def step_blocks(rank: int, src: int, cp: int, local_len: int, causal: bool, window: int | None) -> list[Block]:
    """The (query slice, key slice, kind, position mask) blocks of the step that holds ``src``'s K/V."""
    c = local_len // 2
    every, first, second = slice(0, local_len), slice(0, c), slice(c, local_len)
    if window is None:
        if not causal:
            return [(every, every, "full", None)]
        if src == rank:
            return [(every, every, "causal", None)]
        return [(every, first, "full", None)] if src < rank else [(second, every, "full", None)]
    # A window makes the structure position dependent: classify each pair of chunks on the host.
    q_pos, k_pos = cp_position_ids(local_len, rank, cp), cp_position_ids(local_len, src, cp)
    blocks = []
    for qs in (first, second):
        for ks in (first, second):
            mask = attention_mask(q_pos[qs], k_pos[ks], causal=causal, window=window)
            if not mask.any():
                continue
            if mask.all():
                blocks.append((qs, ks, "full", None))
            elif torch.equal(mask[0], torch.ones(c, c, dtype=torch.bool).tril()):
                blocks.append((qs, ks, "causal", None))
            else:
                blocks.append((qs, ks, "masked", mask))
    return blocks


def _with_documents(blocks: list[Block], q_doc: torch.Tensor | None, k_doc: torch.Tensor | None,
                    device: torch.device) -> list[Block]:
    out = []
    for qs, ks, kind, mask in blocks:
        if q_doc is None:
            out.append((qs, ks, kind, None if mask is None else mask.to(device)))
            continue
        doc = q_doc[:, qs, None] == k_doc[:, None, ks]  # [b, sq, sk]
        if kind == "causal":
            doc = doc & torch.ones(doc.shape[-2:], dtype=torch.bool, device=device).tril()
        elif mask is not None:
            doc = doc & mask.to(device)
        out.append((qs, ks, "masked", doc))
    return out


def build_plan(rank: int, cp: int, local_len: int, causal: bool, window: int | None, q_doc: torch.Tensor | None,
               all_docs: torch.Tensor | None, device: torch.device) -> list[list[Block]]:
    """The blocks of every step, ``plan[i]`` for the K/V of ``src = (rank - i) mod cp``, with their
    masks on ``device``. ``all_docs [b, s]``: every rank's document ids in rank order (or None)."""
    plan = []
    for i in range(cp):
        src = (rank - i) % cp
        k_doc = None if all_docs is None else all_docs[:, src * local_len : (src + 1) * local_len]
        plan.append(_with_documents(step_blocks(rank, src, cp, local_len, causal, window), q_doc, k_doc, device))
    return plan
