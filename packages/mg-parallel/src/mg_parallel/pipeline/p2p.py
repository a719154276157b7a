"""Point-to-point exchange between pipeline stages over the grid's pipeline group.

One call posts all of a rank's sends and receives of one schedule step as a single
``torch.distributed.batch_isend_irecv`` batch (a grouped launch on NCCL; individual
``isend``/``irecv`` on gloo) and returns without waiting: the schedule waits on a received
tensor only right before it uses it, and on its sends at the end. Because the schedule's
timetable pairs every send with a receive posted at the same step on the neighbour, and both
sides issue their steps in the same order, the batches match without any ordering deadlock,
including when both neighbours send to each other in the same step (pp=2, interleaving).

Tensors are sent exactly as the stages produce them: with sequence parallelism an activation is
the rank's ``[s/tp, b, h]`` shard, and every tensor-parallel rank exchanges its own shard with
the same tensor-parallel rank of the neighbouring stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mg_parallel.grid import ProcessGrid

__all__ = ["PendingRecv", "ensure_p2p_ready", "post_step"]

# Pipeline groups (by id) that have already run one collective in this process.
_READY_GROUPS: set[int] = set()


def ensure_p2p_ready(grid: ProcessGrid) -> None:
    """Run one tiny collective over ``grid.pp_group`` the first time it is used (collective).

    NCCL requires the first operation on a communicator to involve all of its ranks, while a
    pipeline's first exchange involves only stages 0 and 1; one all-reduce up front creates the
    communicator on every stage. Cheap and harmless on gloo, where it is done too.
    """
    group = grid.pp_group
    if group is None or id(group) in _READY_GROUPS:
        return
    dist.all_reduce(torch.zeros(1, device=grid.device), group=group)
    _READY_GROUPS.add(id(group))


@dataclass
class PendingRecv:
    """A posted receive: ``tensor`` is valid once :meth:`wait` has returned."""

    tensor: torch.Tensor
    works: list[dist.Work]

    def wait(self) -> torch.Tensor:
        """Block until the tensor has arrived (on NCCL: order the current stream after it)."""
        for work in self.works:
            work.wait()
        self.works = []
        return self.tensor


def post_step(
    grid: ProcessGrid,
    sends: list[tuple[int, torch.Tensor]],
    recvs: list[tuple[int, tuple[int, ...], torch.dtype]],
) -> tuple[list[PendingRecv], list[tuple[dist.Work, torch.Tensor]]]:
    """Post one step's sends and receives with pipeline neighbours, without waiting.

    Args:
        grid: the process grid; peers are pipeline ranks (indices into ``grid.pp_ranks``).
        sends: ``(peer_pp_rank, tensor)``; the tensor must stay unmodified until its work is done.
        recvs: ``(peer_pp_rank, shape, dtype)``; a buffer of that shape is allocated on
            ``grid.device``.

    Returns:
        The pending receives (in ``recvs`` order) and ``(work, tensor)`` of the sends: keep them
        (the tensor must outlive the transfer) and wait on the works before returning.

    Raises:
        RuntimeError: a pipeline exchange is requested without ``torch.distributed`` (pp == 1).
    """
    if not sends and not recvs:
        return [], []
    if grid.pp_group is None:
        raise RuntimeError("pipeline send/recv needs torch.distributed with parallel.pp > 1")
    ops: list[dist.P2POp] = []
    sent = [tensor.contiguous() for _, tensor in sends]
    # Sends first, then receives: within one step a rank sends at most one tensor per peer and
    # receives at most one per peer, so the order inside the batch cannot mismatch.
    for (peer, _), tensor in zip(sends, sent):
        ops.append(dist.P2POp(dist.isend, tensor, grid.pp_ranks[peer], grid.pp_group))
    buffers = []
    for peer, shape, dtype in recvs:
        buf = torch.empty(shape, dtype=dtype, device=grid.device)
        buffers.append(buf)
        ops.append(dist.P2POp(dist.irecv, buf, grid.pp_ranks[peer], grid.pp_group))
    works = dist.batch_isend_irecv(ops)
    if len(works) == len(ops):
        send_works = list(zip(works[: len(sends)], sent))
        pending = [PendingRecv(buf, [w]) for buf, w in zip(buffers, works[len(sends) :])]
    else:
        # A coalesced launch (NCCL) may return one work for the whole batch.
        send_works = [(w, t) for w in works for t in sent]
        pending = [PendingRecv(buf, list(works)) for buf in buffers]
    return pending, send_works
