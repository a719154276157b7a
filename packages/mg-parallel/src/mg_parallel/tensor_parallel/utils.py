"""Small helpers shared by the tensor-parallel layers: group sizes, divisibility, vocab padding,
and the tags that say whether a parameter is split over the tensor-parallel group.

A process group of ``None`` always means "one rank, no communication", so every helper here
works in a single process without ``torch.distributed``.

**Tensor-parallel tags.** Every parameter of an mg layer says at construction whether it is
split over the tensor-parallel group (``param.tensor_parallel = True`` plus
``param.partition_dim``) or replicated (``param.tensor_parallel = False``). The global gradient
norm and checkpoint slicing depend on it at tp > 1, where a missing tag is an error
(:func:`is_tensor_parallel`) rather than a guess: guessing "replicated" for a forgotten shard
would count it on one tp rank only and give a wrong grad norm. Tag plain torch modules (e.g.
``nn.LayerNorm``) with :func:`mark_replicated`; at tp = 1 no tag is needed. The tags are set and read in
:mod:`mg_parallel.tags` (``set_tensor_parallel``, ``mark_replicated`` and ``is_tensor_parallel`` are
importable from here too).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mg_parallel.tags import is_tensor_parallel, mark_replicated, partition_dim, set_tensor_parallel

__all__ = [
    "divide",
    "group_rank",
    "group_size",
    "is_tensor_parallel",
    "mark_replicated",
    "pad_vocab_size",
    "set_tensor_parallel",
    "shard_info",
    "split_along_dim",
    "vocab_range",
]


def group_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks in ``group``; 1 when ``group`` is None (single process)."""
    if group is None:
        return 1
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank inside ``group``; 0 when ``group`` is None."""
    if group is None:
        return 0
    return dist.get_rank(group)


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``, raising when it does not divide exactly.

    Raises:
        ValueError: ``numerator`` is not a multiple of ``denominator``; ``what`` names the
            quantity at fault (e.g. ``"ColumnParallelLinear out_features"``).
    """
    if numerator % denominator != 0:
        raise ValueError(
            f"{what}={numerator} is not divisible by the tensor-parallel size {denominator}; "
            f"choose a size that is a multiple of {denominator} or a smaller tensor-parallel size"
        )
    return numerator // denominator


def split_along_dim(tensor: torch.Tensor, num_parts: int, dim: int) -> list[torch.Tensor]:
    """Split ``tensor`` into ``num_parts`` equal views along ``dim``.

    Raises:
        ValueError: the size of ``dim`` is not divisible by ``num_parts``.
    """
    size = divide(tensor.shape[dim], num_parts, f"tensor dimension {dim}")
    return list(torch.split(tensor, size, dim=dim))


def vocab_range(padded_vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """The ``[start, end)`` vocabulary ids held by ``rank`` when the padded vocabulary is split evenly."""
    per_rank = divide(padded_vocab_size, world_size, "padded vocabulary size")
    return rank * per_rank, (rank + 1) * per_rank


def pad_vocab_size(vocab_size: int, tp_size: int, multiple: int = 128) -> int:
    """Round ``vocab_size`` up to a multiple of ``multiple * tp_size``.

    Every tensor-parallel rank then holds the same number of rows, and that number is a
    multiple of ``multiple`` (friendly to matrix-multiply tile sizes).

    Raises:
        ValueError: a non-positive argument.
    """
    for name, value in (("vocab_size", vocab_size), ("tp_size", tp_size), ("multiple", multiple)):
        if value < 1:
            raise ValueError(f"pad_vocab_size: {name} must be >= 1, got {value}")
    step = multiple * tp_size
    return ((vocab_size + step - 1) // step) * step


def shard_info(param: torch.Tensor, grid: object, *, name: str | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The global shape of ``param`` and the offset of this rank's shard inside it.

    A parameter tagged ``tensor_parallel=True`` by a layer is split evenly along
    ``param.partition_dim`` over ``grid.tp_size`` ranks, this rank holding part ``grid.tp_rank``.
    A parameter tagged ``tensor_parallel=False`` is replicated: its global shape is its local
    shape, offset all zeros; so is every parameter at tp = 1, tagged or not.

    Args:
        param: a parameter (or tensor carrying the same attributes).
        grid: a :class:`mg_parallel.grid.ProcessGrid` (only ``tp_size`` and ``tp_rank`` are read).
        name: the parameter's name, for the error message.

    Returns:
        ``(global_shape, global_offset)`` as tuples of ints, one entry per dimension.

    Raises:
        ValueError: at tp > 1, ``param`` has no tensor-parallel tag (see :func:`is_tensor_parallel`).
    """
    shape = list(param.shape)
    offset = [0] * len(shape)
    if grid.tp_size > 1 and is_tensor_parallel(param, name):
        dim = partition_dim(param, name)
        tp_size, tp_rank = grid.tp_size, grid.tp_rank
        offset[dim] = shape[dim] * tp_rank
        shape[dim] = shape[dim] * tp_size
    return tuple(shape), tuple(offset)
