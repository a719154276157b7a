"""Load-balanced causal chunking of the sequence over the context-parallel group.

With causal attention, token ``t`` attends to ``t + 1`` keys, so cutting the sequence into ``cp``
contiguous pieces would give the last rank ``2cp - 1`` times the work of the first. Instead the
sequence is cut into ``2 * cp`` equal chunks and rank ``r`` holds chunks ``r`` and ``2cp - 1 - r``,
concatenated in that order (Megatron-LM's layout): every rank holds one early and one late chunk,
and every step of ring attention does the same amount of work on every rank.

Example, ``s = 8`` tokens, ``cp = 2``: rank 0 holds tokens ``[0, 1, 6, 7]``, rank 1 ``[2, 3, 4, 5]``.

The functions take the sequence dimension as an argument (``seq_dim``), so the same layout serves
``[b, s]`` token ids, ``[b, s, h]`` hidden states and ``[b, heads, s, d]`` attention inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["cp_position_ids", "gather_from_cp", "split_for_cp", "unsplit_from_cp"]


def _check_length(s: int, cp: int) -> None:
    if s % (2 * cp) != 0:
        raise ValueError(
            f"sequence length {s} is not divisible by 2 * parallel.cp = {2 * cp} (the load-balanced layout cuts it "
            f"into 2*cp chunks); choose a sequence length that is a multiple of {2 * cp}"
        )


def split_for_cp(x: torch.Tensor, cp_rank: int, cp_size: int, seq_dim: int = 1) -> torch.Tensor:
    """This rank's part of a full-sequence tensor: chunks ``cp_rank`` and ``2cp - 1 - cp_rank``.

    Args:
        x: any tensor whose dim ``seq_dim`` is the full sequence ``s``
            (e.g. ``[b, s]`` ids with ``seq_dim=1``, ``[b, heads, s, d]`` with ``seq_dim=2``).
        cp_rank, cp_size: this rank's place in the context-parallel group.
        seq_dim: the sequence dimension.

    Returns:
        A contiguous tensor like ``x`` with ``s / cp`` along ``seq_dim``.

    Raises:
        ValueError: ``s`` is not divisible by ``2 * cp_size``.
    """
    if cp_size == 1:
        return x
    _check_length(x.shape[seq_dim], cp_size)
    chunks = x.chunk(2 * cp_size, dim=seq_dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=seq_dim)


def unsplit_from_cp(parts: Sequence[torch.Tensor], seq_dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`split_for_cp`: the full sequence from every rank's part (in rank order).

    Args:
        parts: ``cp`` tensors, ``parts[r]`` being rank ``r``'s ``s / cp`` tokens along ``seq_dim``.

    Raises:
        ValueError: the parts do not have an even length along ``seq_dim``.
    """
    cp = len(parts)
    if cp == 1:
        return parts[0]
    halves = [p.chunk(2, dim=seq_dim) for p in parts]
    if any(p.shape[seq_dim] % 2 for p in parts):
        raise ValueError(f"every part needs an even length along dim {seq_dim} (two chunks), got "
                         f"{[p.shape[seq_dim] for p in parts]}")
    ordered = [halves[r][0] for r in range(cp)] + [halves[r][1] for r in reversed(range(cp))]
    return torch.cat(ordered, dim=seq_dim)


def gather_from_cp(x: torch.Tensor, group: dist.ProcessGroup | None, seq_dim: int = 1) -> torch.Tensor:
    """All-gather every rank's part over the cp ``group`` and return the full sequence (collective).

    No autograd: use it for outputs, metrics and tests. Returns ``x`` itself for a group of None or
    one rank.
    """
    if group is None or dist.get_world_size(group) == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return unsplit_from_cp(parts, seq_dim)


def cp_position_ids(
    local_len: int, cp_rank: int, cp_size: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions ``[local_len]`` (int64) of this rank's tokens, for RoPE and masks.

    ``local_len`` is ``s / cp`` (this rank's token count). Rank ``r`` holds positions
    ``[r*c, (r+1)*c) + [(2cp-1-r)*c, (2cp-r)*c)`` with chunk size ``c = local_len / 2``.

    Raises:
        ValueError: ``local_len`` is odd while ``cp_size > 1``.
    """
    if cp_size == 1:
        return torch.arange(local_len, device=device)
    if local_len % 2:
        raise ValueError(f"a context-parallel rank holds two equal chunks, so its length must be even, got {local_len}")
    c = local_len // 2
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c, device=device)
    return torch.cat([first, second])
