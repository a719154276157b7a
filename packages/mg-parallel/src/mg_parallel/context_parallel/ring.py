"""Ring attention ("p2p"): K/V blocks travel around the context-parallel ring.

Each of the ``cp`` steps attends this rank's queries to the K/V block it holds while the block
moves on to the next rank (``batch_isend_irecv``, posted before the step's compute). Partial
outputs merge by log-sum-exp. Backward passes K/V around the ring once more, together with the
fp32 gradient accumulators ``dK, dV`` of the block: each rank adds its contribution and forwards
them, and after ``cp`` hops they are back with the block's owner.

With the load-balanced layout (rank ``r`` holds chunks ``r`` and ``2cp-1-r``, each of ``c``
tokens) the causal block structure of step ``i``, K/V from ``src = (r - i) mod cp``, is:

* ``src == r``: the local ``2c x 2c`` block, lower-triangular (causal diagonal);
* ``src < r``: every query against the first ``c`` keys (chunk ``src``), unmasked;
* ``src > r``: the last ``c`` queries (chunk ``2cp-1-r``) against all ``2c`` keys, unmasked;

so every step costs ``2c^2`` scores on every rank (the diagonal step half-masked). A sliding window
cuts blocks into chunk pairs, skips pairs the window leaves empty and masks the rest; document
ids add a data-dependent mask to every block.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mg_parallel.context_parallel.blocks import block_backward, block_forward, merge_into
from mg_parallel.context_parallel.chunking import cp_position_ids
from mg_parallel.context_parallel.comm import RingExchange, gather_seq
from mg_parallel.context_parallel.masks import attention_mask

__all__ = ["ring_attention"]

_KV_TAG, _DKV_TAG = 11, 12
Block = tuple[slice, slice, str, "torch.Tensor | None"]


def _step_blocks(rank: int, src: int, cp: int, local_len: int, causal: bool, window: int | None) -> list[Block]:
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


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, window, q_doc, all_docs, scale, impl):  # noqa: ANN001, ANN205
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        local_len = q.shape[2]
        plan = []
        for i in range(cp):
            src = (rank - i) % cp
            k_doc = None if all_docs is None else all_docs[:, src * local_len : (src + 1) * local_len]
            plan.append(_with_documents(_step_blocks(rank, src, cp, local_len, causal, window), q_doc, k_doc, q.device))
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = [k.contiguous(), v.contiguous()]
        for i in range(cp):
            pending = RingExchange(kv, group, _KV_TAG) if i + 1 < cp else None
            for qs, ks, kind, mask in plan[i]:
                bo, bl = block_forward(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], kind=kind, mask=mask,
                                       scale=scale, impl=impl)
                merge_into(out[:, :, qs], lse[:, :, qs], bo, bl)
            if pending is not None:
                kv = pending.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.plan, ctx.scale, ctx.impl = group, plan, scale, impl
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        group, plan, scale, impl = ctx.group, ctx.plan, ctx.scale, ctx.impl
        cp = dist.get_world_size(group)
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = [k.contiguous(), v.contiguous()]
        dkv_pending = None
        for i in range(cp):
            kv_pending = RingExchange(kv, group, _KV_TAG) if i + 1 < cp else None
            dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
            for qs, ks, kind, mask in plan[i]:
                bdq, bdk, bdv = block_backward(
                    dout[:, :, qs], q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], out[:, :, qs], lse[:, :, qs],
                    delta[:, :, qs], kind=kind, mask=mask, scale=scale, impl=impl,
                )
                dq[:, :, qs] += bdq
                dk[:, :, ks] += bdk
                dv[:, :, ks] += bdv
            if dkv_pending is not None:  # the accumulators of this block from the ranks before
                prev_dk, prev_dv = dkv_pending.wait()
                dk += prev_dk
                dv += prev_dv
            dkv_pending = RingExchange([dk, dv], group, _DKV_TAG)
            if kv_pending is not None:
                kv = kv_pending.wait()
        dk, dv = dkv_pending.wait()  # this rank's own block, after a full turn of the ring
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: dist.ProcessGroup, causal: bool,
    window: int | None, document_ids: torch.Tensor | None, scale: float, impl: str | None = None,
) -> torch.Tensor:
    """Ring attention of this rank's load-balanced part; see
    :func:`~mg_parallel.context_parallel.context_parallel_attention` for shapes."""
    all_docs = None if document_ids is None else gather_seq(document_ids, group, 1)
    return _RingAttention.apply(q, k, v, group, causal, window, document_ids, all_docs, scale, impl)
