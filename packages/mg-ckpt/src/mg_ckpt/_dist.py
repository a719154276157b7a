"""The few collectives mg-ckpt needs, as no-ops in a single process.

Checkpoint coordination runs over a dedicated gloo process group, owned by a
:class:`~mg_ckpt.save.CheckpointSaver` (passed to it, or created once by its constructor): it
carries only small Python objects, works whatever the training backend is, and, being separate
from the training groups, can be used by the background thread of an asynchronous save while the
main thread keeps training. Nothing here creates or caches a group behind the caller's back.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def initialized() -> bool:
    """True when ``torch.distributed`` is initialised (the save/load is collective)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """Global rank, 0 in a single process."""
    return dist.get_rank() if initialized() else 0


def world_size() -> int:
    """World size, 1 in a single process."""
    return dist.get_world_size() if initialized() else 1


def world() -> Any:
    """The current default process group (``None`` in a single process), to notice a re-initialisation."""
    return dist.group.WORLD if initialized() else None


def new_coordination_group() -> Any:
    """A new gloo group of every rank (collective: every rank must call it); ``None`` in a single process."""
    if not initialized():
        return None
    return dist.new_group(backend="gloo")


def check_coordination_group(grp: Any, where: str) -> None:
    """Raise ``ValueError`` unless ``grp`` is a gloo group of every rank of the initialised job."""
    if not initialized():
        raise ValueError(f"{where}: group= was given but torch.distributed is not initialised; pass group=None")
    size = dist.get_world_size(grp)
    if size != dist.get_world_size():
        raise ValueError(
            f"{where}: the checkpoint group must hold every rank ({dist.get_world_size()}), it holds {size}; "
            f"create it with torch.distributed.new_group(backend='gloo')"
        )
    backend = str(dist.get_backend(grp))
    if "gloo" not in backend:
        raise ValueError(
            f"{where}: the checkpoint group must be a gloo group (it carries Python objects from a background "
            f"thread), it is {backend!r}; create it with torch.distributed.new_group(backend='gloo')"
        )


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
