"""The entry point of context-parallel attention and its configuration."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mg_parallel.context_parallel.allgather import AllGatherAttention
from mg_parallel.context_parallel.blocks import default_scale
from mg_parallel.context_parallel.chunking import split_for_cp, unsplit_from_cp
from mg_parallel.context_parallel.comm import gather_seq, heads_to_seq, seq_to_heads
from mg_parallel.context_parallel.dropout import AttentionDropout
from mg_parallel.context_parallel.masks import attention_mask
from mg_parallel.context_parallel.plan import build_plan
from mg_parallel.context_parallel.ring import RingAttention

__all__ = ["CP_COMM_KINDS", "ContextParallelConfig", "check_cp_comm", "context_parallel_attention"]

CP_COMM_KINDS = ("p2p", "allgather", "a2a")
"""The context-parallel communication kinds (``parallel.cp_comm``)."""


def check_cp_comm(comm: str) -> str:
    """Return ``comm`` if it is a known kind.

    Raises:
        ValueError: naming ``parallel.cp_comm`` and the valid kinds.
    """
    if comm not in CP_COMM_KINDS:
        raise ValueError(f"parallel.cp_comm={comm!r} is not a context-parallel communication kind; "
                         f"choose one of {', '.join(CP_COMM_KINDS)}")
    return comm


@dataclass(kw_only=True)
class ContextParallelConfig:
    """How attention runs when the sequence is split over the context-parallel group."""

    comm: str = "p2p"
    """``"p2p"`` (ring attention), ``"allgather"`` (K/V gathered) or ``"a2a"`` (Ulysses head split)."""

    def __post_init__(self) -> None:
        check_cp_comm(self.comm)


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
           scale: float) -> torch.Tensor:
    # One SDPA call over whole (gathered) sequences; the mask gets a head dim to broadcast over. K/V
    # heads are repeated for GQA here rather than by SDPA's enable_gqa, which torch < 2.5 lacks.
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None],
                                          is_causal=is_causal, scale=scale)


def _natural_attention(q, k, v, causal, window, docs, scale):  # noqa: ANN001, ANN202
    # q, k, v hold the whole sequence in its natural order: positions are arange(s).
    if window is None and docs is None:
        return _dense(q, k, v, None, causal, scale)
    pos = torch.arange(q.shape[2], device=q.device)
    return _dense(q, k, v, attention_mask(pos, pos, causal=causal, window=window, q_doc=docs, k_doc=docs),
                  False, scale)


def _a2a_attention(q, k, v, group, causal, window, docs, scale):  # noqa: ANN001, ANN202
    cp = dist.get_world_size(group)
    if q.shape[1] % cp or k.shape[1] % cp:
        raise ValueError(
            f"parallel.cp_comm='a2a' splits the heads over parallel.cp={cp}, but the attention has {q.shape[1]} "
            f"heads and {k.shape[1]} kv heads; both must be divisible by parallel.cp (or use cp_comm p2p/allgather)"
        )
    # The gathered sequence is in rank order; put its chunks in natural order so SDPA can use is_causal (chunk
    # moves, not an index: autograd keeps no index of the whole sequence for backward).
    qh, kh, vh = (unsplit_from_cp(seq_to_heads(t, group).chunk(cp, dim=2), seq_dim=2) for t in (q, k, v))
    all_docs = None if docs is None else unsplit_from_cp(gather_seq(docs, group, 1).chunk(cp, dim=1), seq_dim=1)
    out = _natural_attention(qh, kh, vh, causal, window, all_docs, scale)
    return heads_to_seq(torch.cat([split_for_cp(out, r, cp, seq_dim=2) for r in range(cp)], dim=2), group)


def context_parallel_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: dist.ProcessGroup | None, comm: str = "p2p",
    causal: bool = True, window: int | None = None, document_ids: torch.Tensor | None = None,
    scale: float | None = None, impl: str | None = None, dropout_p: float = 0.0,
    dropout_seed: torch.Tensor | None = None, head_offset: int = 0,
) -> torch.Tensor:
    """Softmax attention over a sequence split across the context-parallel ``group``.

    Every rank passes its load-balanced part of the sequence (:func:`split_for_cp`: chunks ``r`` and
    ``2cp-1-r`` of ``2cp``) and gets the attention output of those tokens over the whole sequence.

    Args:
        q: ``[b, hq, s/cp, d]`` queries of this rank's tokens.
        k, v: ``[b, hkv, s/cp, d]``; ``hq`` a multiple of ``hkv`` (grouped-query attention).
        group: the cp group (``grid.cp_group``); None or one rank is plain attention on ``s`` tokens.
        comm: ``"p2p"`` ring attention, ``"allgather"`` K/V gathered, ``"a2a"`` Ulysses all-to-all
            (needs ``hq`` and ``hkv`` divisible by cp).
        causal: a query sees keys at its position and before.
        window: sliding window (Mistral): a query sees keys at distance ``< window`` (None: no window).
        document_ids: ``[b, s/cp]`` integer id per token of this rank's part (split like the tokens);
            attention stays within a document (packed sequences). None: one document.
        scale: softmax scale, default ``1 / sqrt(d)``.
        impl: per-block kernel of ``"p2p"`` and ``"allgather"`` (``"flash-cpu"``, ``"flash-cuda"`` or ``"reference"``;
            default: chosen by :func:`block_attention_impl`). Ignored by ``"a2a"``, which calls SDPA.
        dropout_p: attention dropout probability (``"p2p"`` and ``"allgather"``): each probability is kept by a
            hash of ``(dropout_seed, batch row, global query head, global query and key positions)``
            (:mod:`~mg_parallel.context_parallel.dropout`), so every layout drops the same ones; the blocks
            then run the reference kernel.
        dropout_seed: 0-dim int64 tensor, required with ``dropout_p > 0`` (draw a fresh one per call, e.g. from
            the tensor-parallel RNG stream, so recomputation replays it).
        head_offset: global index of this rank's first query head (tensor parallelism splits the heads).

    Returns:
        ``[b, hq, s/cp, d]`` in ``q``'s dtype.

    Raises:
        ValueError: unknown ``comm`` (naming ``parallel.cp_comm``), bad shapes, ``window < 1``, unknown ``impl``,
            ``a2a`` with heads not divisible by cp (naming ``parallel.cp`` and the head counts), or dropout with
            ``a2a``, outside ``[0, 1)`` or without a seed.
    """
    check_cp_comm(comm)
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"expected q [b, hq, s, d] and k, v [b, hkv, s, d], got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be >= 1 token (or None), got {window}")
    if impl not in (None, "flash-cpu", "flash-cuda", "reference"):
        raise ValueError(f"impl={impl!r} is not a block kernel; use None (automatic), 'flash-cpu', 'flash-cuda' or "
                         f"'reference'")
    if document_ids is not None and document_ids.shape != (q.shape[0], q.shape[2]):
        raise ValueError(f"document_ids must be [b, s/cp] = {[q.shape[0], q.shape[2]]}, got "
                         f"{list(document_ids.shape)}")
    scale = default_scale(q.shape[-1], scale)
    dropout = None
    if dropout_p:
        if not 0.0 < dropout_p < 1.0 or dropout_seed is None:
            raise ValueError(f"attention dropout needs 0 <= dropout_p < 1 and a dropout_seed tensor, got "
                             f"dropout_p={dropout_p}, dropout_seed={dropout_seed}")
        if comm == "a2a":
            raise ValueError("attention dropout is not supported with parallel.cp_comm='a2a' (its heads run SDPA, "
                             "whose dropout stream depends on the layout); use cp_comm p2p or allgather")
        dropout = AttentionDropout(float(dropout_p), dropout_seed, head_offset)
    if group is None or dist.get_world_size(group) == 1:
        if dropout is not None:
            return _dense_dropout(q, k, v, causal, window, document_ids, scale, dropout)
        return _natural_attention(q, k, v, causal, window, document_ids, scale)
    if q.shape[2] % 2:
        raise ValueError(f"each context-parallel rank holds two equal chunks, so s/cp must be even, got {q.shape[2]}")
    if comm == "a2a":
        return _a2a_attention(q, k, v, group, causal, window, document_ids, scale)
    # p2p and allgather attend the same blocks; they differ in how K/V reach them.
    all_docs = None if document_ids is None else gather_seq(document_ids, group, 1)
    plan = build_plan(dist.get_rank(group), dist.get_world_size(group), q.shape[2], causal, window, document_ids,
                      all_docs, q.device)
    return (RingAttention if comm == "p2p" else AllGatherAttention).apply(q, k, v, group, plan, scale, impl,
                                                                          dropout)


def _dense_dropout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: int | None,
                   docs: torch.Tensor | None, scale: float, dropout: AttentionDropout) -> torch.Tensor:
    # One rank holding the whole sequence in natural order, with the hashed dropout masks: a masked softmax
    # through autograd (a layout of more ranks runs the ring or the all-gather blocks).
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    pos = torch.arange(q.shape[2], device=q.device)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    mask = attention_mask(pos, pos, causal=causal, window=window, q_doc=docs, k_doc=docs)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = scores.softmax(-1).nan_to_num(0.0) * dropout.scale(q.shape[0], q.shape[1], pos, pos)
    return (probs @ v.float()).to(q.dtype)
