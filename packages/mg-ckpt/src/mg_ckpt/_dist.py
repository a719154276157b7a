"""The few collectives mg-ckpt needs, as no-ops in a single process.

Checkpoint coordination runs over a dedicated gloo process group (created once, collectively, on
the first save or load): it carries only small Python objects, works whatever the training
backend is, and, being separate from the training groups, can be used by the background thread
of an asynchronous save while the main thread keeps training.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

_GROUPS: dict[int, Any] = {}


def initialized() -> bool:
    """True when ``torch.distributed`` is initialised (the save/load is collective)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """Global rank, 0 in a single process."""
    return dist.get_rank() if initialized() else 0


def world_size() -> int:
    """World size, 1 in a single process."""
    return dist.get_world_size() if initialized() else 1


def group() -> Any:
    """The checkpoint coordination group (collective on first use); ``None`` in a single process."""
    if not initialized():
        return None
    world = dist.group.WORLD
    key = id(world)
    if key not in _GROUPS:
        _GROUPS.clear()
        _GROUPS[key] = dist.new_group(backend="gloo")
    return _GROUPS[key]


def all_gather(obj: Any, grp: Any) -> list[Any]:
    """Every rank's ``obj``, indexed by rank (``[obj]`` in a single process)."""
    if grp is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=grp)
    return out


def broadcast(obj: Any, grp: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if grp is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=grp)
    return box[0]


def barrier(grp: Any) -> None:
    """Wait for every rank (no-op in a single process)."""
    if grp is not None:
        dist.barrier(group=grp)
