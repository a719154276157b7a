"""All-gather attention ("allgather"): every rank gathers the whole K/V once, then attends its
queries to each rank's part with the same blocks and masks as ring attention
(:mod:`~mg_parallel.context_parallel.plan`), so causal work stays balanced. Only this rank's K/V
are saved for backward (what stays alive is 1/cp of one process's, as for the ring); backward
gathers them again, and sums the fp32 dK/dV of the whole sequence over the group to keep this
rank's part (one reduce-scatter).

One collective each way (two in backward) instead of ``cp - 1`` exchanges, at the price of holding
the K/V of the whole sequence on every rank while the layer's attention runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mg_parallel.context_parallel.blocks import attend_blocks, attend_blocks_backward
from mg_parallel.context_parallel.comm import gather_seq, reduce_scatter_seq
from mg_parallel.context_parallel.ring import new_stats

__all__ = ["AllGatherAttention"]


def _part(x: torch.Tensor, src: int, local_len: int) -> torch.Tensor:
    # Rank src's tokens of a rank-order sequence on dim 2 of [b, h, s, d].
    return x[:, :, src * local_len : (src + 1) * local_len]


class AllGatherAttention(torch.autograd.Function):
    """``apply(q, k, v, group, plan, scale, impl, dropout)``: all-gather attention with the blocks of ``plan``
    (:func:`~mg_parallel.context_parallel.plan.build_plan`); returns ``[b, hq, s/cp, d]``."""

    @staticmethod
    def forward(ctx, q, k, v, group, plan, scale, impl, dropout=None):  # noqa: ANN001, ANN205
        cp, rank, local_len = dist.get_world_size(group), dist.get_rank(group), q.shape[2]
        kv = gather_seq(torch.stack([k, v]), group, 3)  # [2, b, hkv, s, d], rank order
        out, lse = new_stats(q)
        for i in range(cp):
            src = (rank - i) % cp
            attend_blocks(q, _part(kv[0], src, local_len), _part(kv[1], src, local_len), plan[i], out, lse,
                          scale=scale, impl=impl, dropout=dropout)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.plan, ctx.scale, ctx.impl, ctx.dropout = group, plan, scale, impl, dropout
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        cp, rank, local_len = dist.get_world_size(ctx.group), dist.get_rank(ctx.group), q.shape[2]
        kv = gather_seq(torch.stack([k, v]), ctx.group, 3)
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        for i in range(cp):
            src = (rank - i) % cp
            k, v = _part(kv[0], src, local_len), _part(kv[1], src, local_len)
            grads = (dq, _part(dkv[0], src, local_len), _part(dkv[1], src, local_len))
            attend_blocks_backward(dout, q, k, v, out, lse, delta, ctx.plan[i], grads, scale=ctx.scale,
                                   impl=ctx.impl, dropout=ctx.dropout)
        dk, dv = reduce_scatter_seq(dkv, ctx.group, 3).to(kv.dtype)
        return dq.to(q.dtype), dk, dv, None, None, None, None, None
