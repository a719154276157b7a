"""Describing a rank's piece of a logical global tensor, and the box arithmetic used to reshard.

A *block* is an axis-aligned box of the global tensor: ``global_offset`` (its first index along
each dimension) and ``local_shape`` (its size along each dimension). Tensor-parallel shards are
blocks. A *flat range* ``[start, end)`` selects a contiguous run of the row-major flattening of a
block; the distributed optimizer describes its state that way (each data-parallel rank owns a
flat slice of every parameter's tensor-parallel block).

Any flat range of a block is a union of at most ``2 * ndim - 1`` boxes, each of which is
contiguous in the flattening (:func:`flat_range_to_boxes`). Resharding therefore reduces to
intersecting boxes: every saved piece and every piece a rank wants become lists of
:class:`Box` es, and each pairwise intersection is one strided copy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Box", "ShardedTensor", "flat_range_to_boxes", "intersect"]


class ShardedTensor:
    """This rank's piece of a logical global tensor, as saved into / loaded from a checkpoint.

    ``local`` holds either the block ``[global_offset, global_offset + local_shape)`` of the global
    tensor (then ``local.shape == local_shape``), or, when ``flat_range=(start, end)`` is given, the
    elements ``start:end`` of that block's row-major flattening (then ``local`` has ``end - start``
    elements and must be contiguous so that loading can write through a flat view).

    Ranks holding the same piece (data-parallel replicas of a tensor-parallel shard) are
    *replicas*; exactly one of them writes it. ``replica_rank``/``num_replicas`` say which replica
    this rank is; when given (``num_replicas > 1``) the saver checks that exactly that many ranks
    hold the piece, which catches layouts described inconsistently.

    Args:
        local: this rank's data (any device, any dtype safetensors supports).
        global_shape: shape of the whole logical tensor.
        global_offset: first global index of the block along each dimension (zeros if omitted).
        local_shape: shape of the block; defaults to ``local.shape`` (a plain block piece).
        flat_range: ``(start, end)`` within the block's flattening, or ``None`` for the whole block.
        replica_rank: this rank's index among the replicas of the piece.
        num_replicas: number of ranks holding the identical piece.

    Raises:
        ValueError: naming the inconsistent argument (ranks differ, block outside the global
            tensor, flat range outside the block, ``local`` of the wrong size).
    """

    __slots__ = ("local", "global_shape", "global_offset", "local_shape", "flat_range", "replica_rank", "num_replicas")

    def __init__(
        self,
        local: torch.Tensor,
        global_shape: Sequence[int],
        global_offset: Sequence[int] | None = None,
        local_shape: Sequence[int] | None = None,
        flat_range: tuple[int, int] | None = None,
        replica_rank: int = 0,
        num_replicas: int = 1,
    ) -> None:
        if not isinstance(local, torch.Tensor):
            raise ValueError(f"ShardedTensor.local must be a torch.Tensor, got {type(local).__name__}")
        self.local = local
        self.global_shape = tuple(int(s) for s in global_shape)
        ndim = len(self.global_shape)
        self.global_offset = tuple(int(o) for o in global_offset) if global_offset is not None else (0,) * ndim
        if local_shape is None:
            if flat_range is not None:
                raise ValueError("ShardedTensor: flat_range needs local_shape (the shape of the block it flattens)")
            local_shape = tuple(local.shape)
        self.local_shape = tuple(int(s) for s in local_shape)
        self.flat_range = (int(flat_range[0]), int(flat_range[1])) if flat_range is not None else None
        self.replica_rank = int(replica_rank)
        self.num_replicas = int(num_replicas)
        self._validate()

    def _validate(self) -> None:
        g, o, s = self.global_shape, self.global_offset, self.local_shape
        if len(o) != len(g) or len(s) != len(g):
            raise ValueError(
                f"ShardedTensor: global_shape {list(g)}, global_offset {list(o)} and local_shape {list(s)} "
                "must have the same number of dimensions"
            )
        for d in range(len(g)):
            if o[d] < 0 or s[d] < 0 or o[d] + s[d] > g[d]:
                raise ValueError(
                    f"ShardedTensor: block offset {list(o)} + shape {list(s)} leaves global shape {list(g)} "
                    f"along dim {d}; fix the offset/shape of this shard"
                )
        n = math.prod(s)
        if self.flat_range is None:
            if tuple(self.local.shape) != s:
                raise ValueError(f"ShardedTensor: local tensor has shape {list(self.local.shape)}, expected {list(s)}")
        else:
            a, b = self.flat_range
            if not 0 <= a <= b <= n:
                raise ValueError(f"ShardedTensor: flat_range {self.flat_range} is outside the block's 0..{n} elements")
            if self.local.numel() != b - a:
                raise ValueError(
                    f"ShardedTensor: local tensor has {self.local.numel()} elements but flat_range {self.flat_range} "
                    f"selects {b - a}"
                )
        if self.num_replicas < 1 or not 0 <= self.replica_rank < self.num_replicas:
            raise ValueError(
                f"ShardedTensor: replica_rank {self.replica_rank} must be in [0, num_replicas={self.num_replicas})"
            )

    @classmethod
    def from_split(
        cls, local: torch.Tensor, dim: int, rank: int, size: int, *, replica_rank: int = 0, num_replicas: int = 1
    ) -> ShardedTensor:
        """Piece ``rank`` of ``size`` equal splits of the global tensor along ``dim`` (a tensor-parallel shard).

        Raises:
            ValueError: ``rank`` not in ``[0, size)``.
        """
        if not 0 <= rank < size:
            raise ValueError(f"ShardedTensor.from_split: rank {rank} not in [0, {size})")
        shape = list(local.shape)
        global_shape = list(shape)
        global_shape[dim] *= size
        offset = [0] * len(shape)
        offset[dim] = rank * shape[dim]
        return cls(local, global_shape, offset, replica_rank=replica_rank, num_replicas=num_replicas)

    def boxes(self) -> list[Box]:
        """The piece as boxes in global coordinates, each tagged with its start in ``local``'s flattening."""
        if self.flat_range is None:
            return [Box(self.global_offset, self.local_shape, 0)]
        a, b = self.flat_range
        return [
            Box(tuple(o + st for o, st in zip(self.global_offset, box.start)), box.shape, box.flat_start - a)
            for box in flat_range_to_boxes(a, b, self.local_shape)
        ]

    def __repr__(self) -> str:
        fr = f", flat_range={self.flat_range}" if self.flat_range is not None else ""
        return (
            f"ShardedTensor(local={tuple(self.local.shape)} {self.local.dtype}, global_shape={self.global_shape}, "
            f"global_offset={self.global_offset}, local_shape={self.local_shape}{fr}, "
            f"replica {self.replica_rank}/{self.num_replicas})"
        )


@dataclass(frozen=True)
class Box:
    """An axis-aligned box ``[start, start + shape)``; ``flat_start`` locates its data in a flat buffer."""

    start: tuple[int, ...]
    shape: tuple[int, ...]
    flat_start: int = 0

    @property
    def numel(self) -> int:
        """Number of elements in the box."""
        return math.prod(self.shape)


def flat_range_to_boxes(a: int, b: int, shape: Sequence[int]) -> list[Box]:
    """Split elements ``[a, b)`` of the row-major flattening of a tensor of ``shape`` into boxes.

    Each returned box is contiguous in the flattening; ``box.flat_start`` is the flat index of its
    first element. At most ``2 * len(shape) - 1`` boxes; empty ranges give no boxes.
    """
    shape = tuple(int(s) for s in shape)
    if a >= b:
        return []
    if not shape:
        return [Box((), (), 0)]
    inner = math.prod(shape[1:])
    out: list[Box] = []

    def sub(row: int, lo: int, hi: int) -> None:
        # A run inside one leading index: recurse on the trailing dimensions.
        for box in flat_range_to_boxes(lo, hi, shape[1:]):
            out.append(Box((row, *box.start), (1, *box.shape), row * inner + box.flat_start))

    if inner == 0:
        return []
    r0, r1 = a // inner, b // inner
    if r0 == r1:
        sub(r0, a - r0 * inner, b - r0 * inner)
        return out
    if a % inner:
        sub(r0, a % inner, inner)
        r0 += 1
    if r1 > r0:
        out.append(Box((r0, *(0,) * (len(shape) - 1)), (r1 - r0, *shape[1:]), r0 * inner))
    if b % inner:
        sub(r1, 0, b % inner)
    return out


def intersect(x: Box, y: Box) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The intersection of two boxes as ``(start, shape)``, or ``None`` when it is empty."""
    start, shape = [], []
    for xs, xn, ys, yn in zip(x.start, x.shape, y.start, y.shape):
        lo, hi = max(xs, ys), min(xs + xn, ys + yn)
        if hi <= lo:
            return None
        start.append(lo)
        shape.append(hi - lo)
    return tuple(start), tuple(shape)
