"""Attention dropout that any layout of the sequence reproduces: masks are a hash of global coordinates.

Blockwise attention never holds a query row's probabilities at once, and its backward recomputes each
block, so the dropout mask of a block must be regenerated from something other than a random stream.
Each attention probability ``(batch row b, query head h, query position i, key position j)`` is kept
when a counter-based hash (SplitMix64's finaliser) of ``(seed, b, h, i, j)`` reaches the drop
probability, and kept ones are scaled by ``1 / (1 - p)``: the same mask whatever cp, comm kind or
block cut computes it, and in backward. ``i`` and ``j`` are global positions, ``h`` the global query
head (tensor-parallel ranks pass the offset of their heads).

Dropout multiplies the probabilities after the softmax, so a block's log-sum-exp (over the undropped
scores) merges as without dropout, and the softmax backward's row term stays ``rowsum(dO * O)`` of the
dropped output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AttentionDropout", "dropout_keep_mask"]

_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    # A 64-bit constant as the int64 torch stores (two's complement).
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)
_STRIDES = (_signed(0xD1B54A32D192ED03), _signed(0xAEF17502108EF2D9), _signed(0xDB4F0B9175AE2165),
            _signed(0x8CB92BA72F3D8DD7))
_BITS = 24


def _shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    # Logical right shift of int64 (torch's is arithmetic).
    return (x >> n) & ((1 << (64 - n)) - 1)


def dropout_keep_mask(seed: torch.Tensor, p: float, batch: int, heads: torch.Tensor, q_pos: torch.Tensor,
                      k_pos: torch.Tensor) -> torch.Tensor:
    """Which attention probabilities dropout keeps: bool ``[batch, len(heads), len(q_pos), len(k_pos)]``.

    Args:
        seed: 0-dim int64 tensor (on the device: drawing it needs no host read).
        p: drop probability in ``[0, 1)``.
        batch: batch rows (row ``b`` is hashed as ``b``).
        heads, q_pos, k_pos: int64 global query-head indices and global query / key positions.
    """
    device = q_pos.device
    b = torch.arange(batch, device=device, dtype=torch.int64)
    x = (seed.to(device, torch.int64) * _GOLDEN
         + b.view(-1, 1, 1, 1) * _STRIDES[0] + heads.to(torch.int64).view(1, -1, 1, 1) * _STRIDES[1]
         + q_pos.to(torch.int64).view(1, 1, -1, 1) * _STRIDES[2]
         + k_pos.to(torch.int64).view(1, 1, 1, -1) * _STRIDES[3])
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    x = x ^ _shift_right(x, 31)
    return _shift_right(x, 64 - _BITS) >= round(p * (1 << _BITS))


@dataclass(frozen=True)
class AttentionDropout:
    """Dropout of one attention call: probability ``p``, its ``seed`` and the global index of this rank's
    first query head (``head_offset``, nonzero under tensor parallelism)."""

    p: float
    seed: torch.Tensor
    head_offset: int = 0

    def scale(self, batch: int, num_heads: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """fp32 ``[batch, heads, sq, sk]``: ``1 / (1 - p)`` where kept, 0 where dropped."""
        heads = torch.arange(self.head_offset, self.head_offset + num_heads, device=q_pos.device)
        keep = dropout_keep_mask(self.seed, self.p, batch, heads, q_pos, k_pos)
        return keep.to(torch.float32) * (1.0 / (1.0 - self.p))
