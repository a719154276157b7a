"""Ring attention ("p2p"): K/V blocks travel around the context-parallel ring.

Each of the ``cp`` steps attends this rank's queries to the K/V block it holds (the blocks and masks
of :mod:`~mg_parallel.context_parallel.plan`) while that block moves on to the next rank
(``batch_isend_irecv``, posted before the step's compute, so the transfer overlaps it). Partial
outputs merge by log-sum-exp. Backward passes K/V around the ring once more, together with the fp32
gradient accumulators ``dK, dV`` of the block: each rank adds its contribution and forwards them,
and after ``cp`` hops they are back with the block's owner.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mg_parallel.context_parallel.blocks import attend_blocks, attend_blocks_backward
from mg_parallel.context_parallel.comm import RingExchange

__all__ = ["RingAttention", "new_stats"]

_KV_TAG, _DKV_TAG = 11, 12


def new_stats(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty running statistics for ``q [b, h, s, d]``: fp32 output zeros and log-sum-exp ``-inf``."""
    return (torch.zeros(q.shape, dtype=torch.float32, device=q.device),
            torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device))


class RingAttention(torch.autograd.Function):
    """``apply(q, k, v, group, plan, scale, impl, dropout)``: ring attention with the blocks of ``plan``
    (:func:`~mg_parallel.context_parallel.plan.build_plan`); returns ``[b, hq, s/cp, d]``."""

    @staticmethod
    def forward(ctx, q, k, v, group, plan, scale, impl, dropout=None):  # noqa: ANN001, ANN205
        cp = dist.get_world_size(group)
        out, lse = new_stats(q)
        kv = [k.contiguous(), v.contiguous()]
        for i in range(cp):
            pending = RingExchange(kv, group, _KV_TAG) if i + 1 < cp else None
            attend_blocks(q, kv[0], kv[1], plan[i], out, lse, scale=scale, impl=impl,
                          dropout=dropout)
            if pending is not None:
                kv = pending.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.plan, ctx.scale, ctx.impl, ctx.dropout = group, plan, scale, impl, dropout
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        cp = dist.get_world_size(ctx.group)
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = [k.contiguous(), v.contiguous()]
        dkv_pending = None
        for i in range(cp):
            kv_pending = RingExchange(kv, ctx.group, _KV_TAG) if i + 1 < cp else None
            dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
            attend_blocks_backward(dout, q, kv[0], kv[1], out, lse, delta, ctx.plan[i], (dq, dk, dv),
                                   scale=ctx.scale, impl=ctx.impl, dropout=ctx.dropout)
            if dkv_pending is not None:  # the accumulators of this block from the ranks before
                prev_dk, prev_dv = dkv_pending.wait()
                dk += prev_dk
                dv += prev_dv
            dkv_pending = RingExchange([dk, dv], ctx.group, _DKV_TAG)
            if kv_pending is not None:
                kv = kv_pending.wait()
        dk, dv = dkv_pending.wait()  # this rank's own block, after a full turn of the ring
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None
