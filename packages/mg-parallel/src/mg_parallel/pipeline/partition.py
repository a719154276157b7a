"""Splitting a stack of layers into pipeline stages (and virtual stages)."""

from __future__ import annotations

__all__ = ["partition_layers"]


def partition_layers(
    num_layers: int, pp: int, vpp: int = 1, first: int | None = None, last: int | None = None
) -> list[list[range]]:
    """Layer index ranges of every pipeline rank and model chunk.

    The ``pp * vpp`` virtual stages take consecutive blocks of layers; virtual stage
    ``s = chunk * pp + rank`` lives on pipeline rank ``rank`` as model chunk ``chunk`` (so with
    interleaving a rank holds non-adjacent blocks). By default every virtual stage gets the same
    number of layers. ``first``/``last`` fix the number of transformer layers of the first/last
    virtual stage, to leave room for the embedding or the output head and loss (which cost
    about as much as a layer or more with a large vocabulary); the remaining layers are split
    evenly over the other virtual stages. ``first=0`` or ``last=0`` is allowed (a stage holding
    only the embedding or the head).

    Returns:
        ``ranges[rank][chunk]``: the ``range`` of global layer indices of that chunk.

    Raises:
        ValueError: a size is not positive, ``first``/``last`` do not fit ``num_layers``, or the
            layers cannot be split evenly (the message gives the numbers and what to change).
    """
    for name, value in (("num_layers", num_layers), ("pp", pp), ("vpp", vpp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"partition_layers: {name} must be a positive integer, got {value!r}")
    for name, value in (("first", first), ("last", last)):
        if value is not None and (not isinstance(value, int) or value < 0):
            raise ValueError(f"partition_layers: {name} must be None or a non-negative integer, got {value!r}")
    stages = pp * vpp
    if stages == 1:
        if (first is not None and first != num_layers) or (last is not None and last != num_layers):
            raise ValueError(
                f"partition_layers: with a single stage first/last must be unset or {num_layers}, "
                f"got first={first}, last={last}"
            )
        return [[range(num_layers)]]
    fixed = {0: first, stages - 1: last}
    fixed = {s: n for s, n in fixed.items() if n is not None}
    rest = num_layers - sum(fixed.values())
    free = stages - len(fixed)
    if rest < 0 or (free == 0 and rest != 0):
        raise ValueError(
            f"partition_layers: first={first} + last={last} layers do not fit num_layers={num_layers} "
            f"over {stages} stages; choose first + last <= num_layers with the rest divisible by the other stages"
        )
    if free and rest % free != 0:
        hint = "set first=/last= so that the remaining layers divide evenly" if not fixed else "adjust first=/last="
        raise ValueError(
            f"partition_layers: {rest} layers cannot be split evenly over {free} pipeline stages "
            f"(num_layers={num_layers}, pp={pp}, vpp={vpp}, first={first}, last={last}); {hint}"
        )
    sizes = [fixed.get(s, rest // free if free else 0) for s in range(stages)]
    starts = [sum(sizes[:s]) for s in range(stages)]
    return [[range(starts[c * pp + r], starts[c * pp + r] + sizes[c * pp + r]) for c in range(vpp)] for r in range(pp)]
