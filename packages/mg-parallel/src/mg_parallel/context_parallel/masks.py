"""Which keys a query may attend to, from global positions and document ids.

A query at global position ``i`` may attend to a key at position ``j`` when all of these hold:

* causal: ``j <= i``;
* sliding window ``w`` (Mistral): ``i - j < w`` when causal, ``|i - j| < w`` when bidirectional;
* document ids (packed sequences): the two tokens carry the same id.
"""

from __future__ import annotations

import torch

__all__ = ["attention_mask", "document_ids_from_cu_seqlens"]


def attention_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, *, causal: bool, window: int | None,
    q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Boolean mask (True = attend) ``[1 or b, sq, sk]``, or None when every query sees every key.

    Args:
        q_pos, k_pos: global positions ``[sq]``, ``[sk]`` (int).
        causal, window: see the module docstring; ``window=None`` means no window.
        q_doc, k_doc: document ids ``[b, sq]``, ``[b, sk]``, or both None.
    """
    mask = None
    if causal or window is not None:
        diff = q_pos[:, None] - k_pos[None, :]  # i - j
        if causal:
            mask = diff >= 0
        if window is not None:
            near = diff < window if causal else diff.abs() < window
            mask = near if mask is None else mask & near
        mask = mask[None]
    if q_doc is not None:
        same = q_doc[:, :, None] == k_doc[:, None, :]
        mask = same if mask is None else mask & same
    return mask


def document_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Per-token document ids ``[seq_len]`` (int64) from cumulative lengths ``[0, l0, l0+l1, ...]``.

    Token ``t`` gets the index of the document containing it; tokens at or past ``cu_seqlens[-1]``
    (padding) get one more id, so they attend only to each other. Split the result like the tokens
    (``split_for_cp(ids, rank, cp, seq_dim=0)``) before passing it to attention.

    Raises:
        ValueError: ``cu_seqlens`` does not start at 0, decreases, or ends past ``seq_len``.
    """
    cu = cu_seqlens.to(torch.int64)
    if cu.dim() != 1 or cu.numel() == 0 or cu[0] != 0 or bool((cu[1:] < cu[:-1]).any()) or cu[-1] > seq_len:
        raise ValueError(f"cu_seqlens must be non-decreasing cumulative lengths from 0 to at most {seq_len}, "
                         f"got {cu_seqlens.tolist()}")
    return torch.searchsorted(cu[1:], torch.arange(seq_len, device=cu.device), right=True)
