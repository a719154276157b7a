"""Communication of context-parallel attention: the ring exchange, the all-gather and
reduce-scatter of the sequence, and the Ulysses all-to-all as an autograd function (its adjoint in
backward).

Tensors follow the attention layout ``[b, heads, s, d]``; "rank order" means the concatenation of
every rank's load-balanced part (see :mod:`~mg_parallel.context_parallel.chunking`), rank 0 first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mg_parallel import collectives

__all__ = ["RingExchange", "gather_seq", "heads_to_seq", "reduce_scatter_seq", "seq_to_heads"]


class RingExchange:
    """Send ``tensors`` to the next rank of the ring and receive as many from the previous one.

    The sends and receives are posted at once (``batch_isend_irecv``) and run while the caller
    computes; :meth:`wait` returns the received tensors. Every rank of ``group`` must post the same
    sequence of exchanges (same shapes, same order): ring attention does.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, tag: int = 0) -> None:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        nxt = dist.get_global_rank(group, (rank + 1) % world)
        prev = dist.get_global_rank(group, (rank - 1) % world)
        self.received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group, tag) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, prev, group, tag) for r in self.received]
        self._works = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        """Block until this exchange is done; the tensors received from the previous rank."""
        for work in self._works:
            work.wait()
        return self.received


def gather_seq(x: torch.Tensor, group: dist.ProcessGroup, seq_dim: int) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``seq_dim`` in rank order (collective, no autograd)."""
    world = dist.get_world_size(group)
    moved = x.movedim(seq_dim, 0).contiguous()
    out = torch.empty((world * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
    collectives.all_gather_into_tensor(out, moved, group=group)
    return out.movedim(0, seq_dim)


def reduce_scatter_seq(x: torch.Tensor, group: dist.ProcessGroup, seq_dim: int) -> torch.Tensor:
    """Sum ``x`` (every rank's parts in rank order along ``seq_dim``) over ranks; this rank's part
    (collective, no autograd)."""
    world = dist.get_world_size(group)
    moved = x.movedim(seq_dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // world, *moved.shape[1:]), dtype=x.dtype, device=x.device)
    collectives.reduce_scatter_tensor(out, moved, group=group)
    return out.movedim(0, seq_dim)


def _a2a_seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    # [b, h, s_l, d] -> [b, h/cp, cp*s_l, d]: head group j goes to rank j, sequence parts come back.
    world = dist.get_world_size(group)
    b, h, s, d = x.shape
    send = x.reshape(b, world, h // world, s, d).movedim(1, 0).contiguous()  # [cp, b, h/cp, s_l, d]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: rank j's tokens of my heads
    return recv.movedim(0, 2).reshape(b, h // world, world * s, d)


def _a2a_heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    # [b, h/cp, cp*s_l, d] -> [b, h, s_l, d]: the inverse of _a2a_seq_to_heads.
    world = dist.get_world_size(group)
    b, hp, s, d = x.shape
    send = x.reshape(b, hp, world, s // world, d).movedim(2, 0).contiguous()  # [cp, b, h/cp, s_l, d]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: my tokens of rank j's heads
    return recv.movedim(0, 1).reshape(b, world * hp, s // world, d)


class _UlyssesAllToAll(torch.autograd.Function):
    """Ulysses all-to-all between the sequence split and the head split; backward goes the other way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return (_a2a_seq_to_heads if to_heads else _a2a_heads_to_seq)(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return (_a2a_heads_to_seq if ctx.to_heads else _a2a_seq_to_heads)(grad, ctx.group), None, None


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[b, h, s/cp, d]`` (this rank's tokens, all heads) -> ``[b, h/cp, s, d]`` (all tokens in rank
    order, heads ``[r*h/cp, (r+1)*h/cp)``). Differentiable; ``h`` must be divisible by cp."""
    return _UlyssesAllToAll.apply(x, group, True)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Inverse of :func:`seq_to_heads`: ``[b, h/cp, s, d]`` -> ``[b, h, s/cp, d]``. Differentiable."""
    return _UlyssesAllToAll.apply(x, group, False)
