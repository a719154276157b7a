"""Token dispatch: send each (token, chosen expert) pair to the ep rank holding that expert and back.

Global expert ``e`` lives on ep rank ``e // E_local`` (``E_local = num_experts / ep``). A
dispatcher's ``dispatch(x, probs, indices)`` returns the rows its local experts must compute,
grouped by local expert, with the row count of each; ``combine(y)`` returns every token's
``sum_j probs[t, j] * expert_{indices[t, j]}(x[t])`` on the rank that routed it.

**Capacity** (``moe_expert_capacity_factor = c``). Each rank lets at most
``capacity = ceil(T * k / N * c)`` of its own ``T`` tokens into each expert. The rule, applied
per rank and per expert before any communication: keep the ``capacity`` assignments with the
highest router probability, ties going to the lower token index. A dropped assignment contributes
nothing to its token's output (the other choices keep their probabilities). With
``moe_pad_expert_input_to_capacity`` every expert's input is padded with zero rows to exactly
``capacity`` rows per sending rank (their outputs are discarded), so shapes do not depend on routing.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mg_parallel.moe.comm import all_to_all, exchange_counts
from mg_parallel.moe.config import MoEConfig
from mg_parallel.tensor_parallel.mappings import (
    all_gather_dim0,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from mg_parallel.tensor_parallel.utils import group_rank, group_size

__all__ = ["AllGatherDispatcher", "AllToAllDispatcher", "build_dispatcher", "expert_capacity", "keep_within_capacity"]


def expert_capacity(num_tokens: int, topk: int, num_experts: int, factor: float) -> int:
    """``ceil(num_tokens * topk / num_experts * factor)``: assignments one rank may send to one expert."""
    return math.ceil(num_tokens * topk / num_experts * factor)


def keep_within_capacity(indices: torch.Tensor, probs: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """The assignments kept under ``capacity``: per expert the highest-probability ones, ties by token index.

    Args:
        indices: ``[T, k]`` chosen experts; probs: ``[T, k]`` their probabilities.

    Returns:
        ``[T, k]`` bool, True where the assignment is kept.
    """
    flat_e, flat_p = indices.flatten(), probs.detach().flatten()
    by_prob = torch.argsort(-flat_p, stable=True)  # stable: equal probabilities keep token order
    order = by_prob[torch.argsort(flat_e[by_prob], stable=True)]  # by expert, then prob, then token
    counts = torch.bincount(flat_e, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(order.numel(), device=order.device) - starts[flat_e[order]]
    keep = torch.zeros_like(flat_e, dtype=torch.bool)
    keep[order[rank_in_expert < capacity]] = True
    return keep.view_as(indices)


def _sort_by_bin(bins: torch.Tensor, num_bins: int, pad_to: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Assignment ids grouped by bin (stable), ``bins[a] < 0`` skipped; pad slots hold ``bins.numel()``.

    Returns ``(slots [M], counts [num_bins])``.
    """
    valid = bins >= 0
    key = torch.where(valid, bins, num_bins)
    n_valid = int(valid.sum())
    order = torch.argsort(key, stable=True)[:n_valid]
    counts = torch.bincount(bins[valid], minlength=num_bins)
    if pad_to is None:
        return order, counts
    starts = torch.cumsum(counts, 0) - counts
    b = bins[order]
    dest = b * pad_to + torch.arange(n_valid, device=bins.device) - starts[b]
    slots = torch.full((num_bins * pad_to,), bins.numel(), dtype=order.dtype, device=bins.device)
    slots[dest] = order
    return slots, torch.full_like(counts, pad_to)


def _rows(t: torch.Tensor, index: torch.Tensor, padded: bool) -> torch.Tensor:
    """``t[index]``, where with ``padded`` the index ``len(t)`` selects a row of zeros."""
    if padded:
        t = torch.cat([t, t.new_zeros((1, *t.shape[1:]))])
    return t.index_select(0, index)


class _Dispatcher:
    """Shared parts: the capacity rule and the final weighted scatter-add."""

    def __init__(self, num_experts: int, ep_group: dist.ProcessGroup | None, config: MoEConfig) -> None:
        self.num_experts, self.config, self.ep_group = num_experts, config, ep_group
        self.ep, self.ep_rank = group_size(ep_group), group_rank(ep_group)
        self.num_local_experts = num_experts // self.ep
        self.dropped: torch.Tensor | int = 0
        """Choices (token, expert) the last dispatch dropped for capacity (a 0-d tensor, or 0 when dropless)."""

    def _capacity(self, num_tokens: int) -> int | None:
        factor = self.config.moe_expert_capacity_factor
        return None if factor is None else expert_capacity(num_tokens, self.config.moe_router_topk, self.num_experts, factor)

    def _targets(self, indices: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        """Global expert of each assignment ``[T*k]``, -1 where capacity drops it; and the capacity."""
        capacity = self._capacity(indices.shape[0])
        targets = indices.flatten()
        self.dropped = 0
        if capacity is not None:
            keep = keep_within_capacity(indices, probs, self.num_experts, capacity).flatten()
            targets = torch.where(keep, targets, -1)
            self.dropped = (~keep).sum()
        return targets, capacity

    def _pad(self, capacity: int | None) -> int | None:
        return capacity if self.config.moe_pad_expert_input_to_capacity else None


class AllToAllDispatcher(_Dispatcher):
    """Permute by expert, exchange variable-size chunks over ep with ``all_to_all_single``, and back.

    Forward communication: one all-to-all of ``[N]`` counts (their sizes decide the splits, read
    on the host), one of the token rows; ``combine`` one more; backward mirrors them.
    """

    def dispatch(self, x: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, h]``, ``probs``/``indices [T, k]`` -> (rows for the local experts ``[M, h]``, rows per local expert)."""
        k = indices.shape[1]
        targets, capacity = self._targets(indices, probs)
        slots, counts = _sort_by_bin(targets, self.num_experts, self._pad(capacity))
        self.num_tokens, self.slots = x.shape[0], slots
        self.slot_tokens = torch.where(slots < targets.numel(), slots // k, x.shape[0])  # pad rows -> T
        padded = self._pad(capacity) is not None
        self.slot_probs = _rows(probs.reshape(-1, 1), slots, padded)  # [M, 1], 0 for pad rows
        rows = _rows(x, self.slot_tokens, padded)  # [M, h] sorted by global expert
        received = exchange_counts(counts, self.ep_group)  # [ep, E_local]
        self.send_splits = counts.view(self.ep, -1).sum(1).tolist()
        self.recv_splits = received.sum(1).tolist()
        rows = all_to_all(rows, self.ep_group, self.recv_splits, self.send_splits)  # by (source rank, local expert)
        per_expert = received.sum(0)
        if self.ep > 1:  # regroup (source, expert) chunks into (expert, source) order
            sizes = received.flatten()
            starts = (torch.cumsum(sizes, 0) - sizes).view(self.ep, -1).t().flatten()
            sizes_t = received.t().flatten()
            ends_t = torch.cumsum(sizes_t, 0)
            self.regroup = torch.arange(int(ends_t[-1]), device=x.device) + torch.repeat_interleave(
                starts - (ends_t - sizes_t), sizes_t
            )
            rows = rows[self.regroup]
        return rows, per_expert

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        """Expert outputs ``[M, h]`` (order of ``dispatch``) -> ``[T, h]`` weighted sums on the routing rank."""
        if self.ep > 1:
            y = y[torch.argsort(self.regroup)]
        y = all_to_all(y, self.ep_group, self.send_splits, self.recv_splits)  # back in slot order
        out = y.new_zeros((self.num_tokens + 1, y.shape[1]))
        out = out.index_add(0, self.slot_tokens, y * self.slot_probs)
        return out[: self.num_tokens]


class AllGatherDispatcher(_Dispatcher):
    """Every ep rank gathers every ep peer's tokens and computes its local experts on the ones routed there.

    Needs the same token count on every ep rank. Forward: all-gathers of tokens, probabilities and
    choices, and a reduce-scatter of the outputs; backward the adjoints.
    """

    def dispatch(self, x: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Same contract as :meth:`AllToAllDispatcher.dispatch`."""
        k, e_local = indices.shape[1], self.num_local_experts
        targets, capacity = self._targets(indices, probs)
        x_all = gather_from_sequence_parallel_region(x, self.ep_group)  # [ep*T, h]
        probs_all = gather_from_sequence_parallel_region(probs, self.ep_group)  # [ep*T, k]
        if self.ep > 1:
            targets = all_gather_dim0(targets.view(-1, k), self.ep_group).flatten()
        lo = self.ep_rank * e_local
        local = torch.where((targets >= lo) & (targets < lo + e_local), targets - lo, -1)
        pad = self._pad(capacity)
        slots, per_expert = _sort_by_bin(local, e_local, None if pad is None else pad * self.ep)
        self.num_tokens = x_all.shape[0]
        self.slot_tokens = torch.where(slots < local.numel(), slots // k, x_all.shape[0])
        self.slot_probs = _rows(probs_all.reshape(-1, 1), slots, pad is not None)
        return _rows(x_all, self.slot_tokens, pad is not None), per_expert

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        """Same contract as :meth:`AllToAllDispatcher.combine`."""
        out = y.new_zeros((self.num_tokens + 1, y.shape[1]))
        out = out.index_add(0, self.slot_tokens, y * self.slot_probs)[: self.num_tokens]
        return reduce_scatter_to_sequence_parallel_region(out, self.ep_group)


def build_dispatcher(num_experts: int, ep_group: dist.ProcessGroup | None, config: MoEConfig) -> _Dispatcher:
    """The dispatcher ``config.moe_token_dispatcher_type`` names."""
    cls = AllToAllDispatcher if config.moe_token_dispatcher_type == "alltoall" else AllGatherDispatcher
    return cls(num_experts, ep_group, config)
