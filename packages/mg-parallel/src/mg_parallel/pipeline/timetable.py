"""Which operation each pipeline rank runs when, and which messages it exchanges.

A schedule is first written as a per-rank *order* of operations (``F``/``B`` of one microbatch on
one model chunk): 1F1B and interleaved 1F1B differ only in that order. The order is then played
on a simulated clock of unit steps: at step ``t`` a rank runs its next operation if the message
it depends on was produced at an earlier step. Each message is exchanged at the step that
produced it, on both sides (the sender sends it, the receiver posts the matching receive), so

* every rank issues its point-to-point operations in increasing step order, and within a step a
  rank sends at most one message per neighbour: the sends and receives of any pair of ranks
  therefore match one to one, in the same order, on gloo and NCCL alike;
* a rank only waits for a message whose send was issued at an earlier step, so no cycle of
  waits can form: the schedule is deadlock-free by construction (the simulation itself raises
  if an order could never complete, which would be a bug in the order, not a hang at run time).

The plan is a pure function of ``(pp, v, m, forward_only)``, computed identically on every rank.

Virtual stages: with ``v`` model chunks per rank, chunk ``c`` of pipeline rank ``r`` is virtual
stage ``s = c * pp + r`` of ``pp * v``; activations flow from virtual stage ``s`` to ``s + 1``
(rank ``(r + 1) % pp``, wrapping from the last rank to the first) and gradients the other way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

__all__ = ["Message", "Op", "Step", "pipeline_plan", "stage_order", "warmup_count"]


@dataclass(frozen=True)
class Op:
    """One forward (``kind="F"``) or backward (``kind="B"``) pass of a microbatch on a chunk."""

    kind: str
    chunk: int
    microbatch: int


@dataclass(frozen=True)
class Message:
    """An activation (``"act"``) or gradient (``"grad"``) produced on virtual stage ``stage``."""

    kind: str
    stage: int
    microbatch: int


@dataclass
class Step:
    """What one rank does at one clock step: an optional op, then sends and posted receives.

    ``sends``/``recvs`` hold ``(peer_pp_rank, message)``; a send carries the tensor produced by
    ``op`` of this same step.
    """

    op: Op | None
    sends: list[tuple[int, Message]] = field(default_factory=list)
    recvs: list[tuple[int, Message]] = field(default_factory=list)


def warmup_count(pp_rank: int, pp_size: int, num_chunks: int, num_microbatches: int) -> int:
    """Number of forward passes a rank runs before its first backward.

    1F1B (one chunk): ``pp - rank - 1``, so the last stage alternates from the start. Interleaved
    (``v`` chunks): ``2 * (pp - rank - 1) + (v - 1) * pp``: every chunk of the first group of
    ``pp`` microbatches is in flight before the pipeline turns round. Capped at the total number
    of forward passes ``v * m``.
    """
    total = num_chunks * num_microbatches
    if num_chunks == 1:
        return min(pp_size - pp_rank - 1, total)
    return min(2 * (pp_size - pp_rank - 1) + (num_chunks - 1) * pp_size, total)


def _virtual_op(kind: str, k: int, pp_size: int, num_chunks: int) -> Op:
    # Microbatches go through the chunks in groups of pp: chunk 0 takes microbatches 0..pp-1,
    # then chunk 1 takes the same ones, ... then the next group. Backward visits chunks in reverse.
    group, within = divmod(k, pp_size * num_chunks)
    chunk = within // pp_size
    if kind == "B":
        chunk = num_chunks - 1 - chunk
    return Op(kind, chunk, group * pp_size + within % pp_size)


def stage_order(
    pp_rank: int, pp_size: int, num_chunks: int, num_microbatches: int, forward_only: bool = False
) -> list[Op]:
    """The order of operations of one pipeline rank: warm-up forwards, 1F1B steady state, cool-down.

    With ``num_chunks == 1`` this is 1F1B; with more it is the interleaved schedule (then
    ``num_microbatches`` must be a multiple of ``pp_size``; callers check this first).
    """
    total = num_chunks * num_microbatches
    forwards = [_virtual_op("F", k, pp_size, num_chunks) for k in range(total)]
    if forward_only:
        return forwards
    backwards = [_virtual_op("B", k, pp_size, num_chunks) for k in range(total)]
    warmup = warmup_count(pp_rank, pp_size, num_chunks, num_microbatches)
    order = forwards[:warmup]
    for i in range(total - warmup):
        order += [forwards[warmup + i], backwards[i]]
    order += backwards[total - warmup :]
    return order


def _needs(op: Op, rank: int, pp_size: int, last_stage: int) -> Message | None:
    stage = op.chunk * pp_size + rank
    if op.kind == "F":
        return None if stage == 0 else Message("act", stage - 1, op.microbatch)
    return None if stage == last_stage else Message("grad", stage + 1, op.microbatch)


def _produces(op: Op, rank: int, pp_size: int, last_stage: int) -> tuple[int, Message] | None:
    stage = op.chunk * pp_size + rank
    if op.kind == "F":
        return None if stage == last_stage else ((rank + 1) % pp_size, Message("act", stage, op.microbatch))
    return None if stage == 0 else ((rank - 1) % pp_size, Message("grad", stage, op.microbatch))


@functools.lru_cache(maxsize=64)
def pipeline_plan(
    pp_size: int, num_chunks: int, num_microbatches: int, forward_only: bool = False
) -> tuple[tuple[Step, ...], ...]:
    """Play every rank's :func:`stage_order` on a unit-step clock; return each rank's steps.

    Steps where a rank neither computes nor communicates are left out, so ``plan[r]`` is the
    exact sequence rank ``r`` executes.

    Raises:
        RuntimeError: the orders can never complete (a schedule bug; never for valid inputs).
    """
    orders = [stage_order(r, pp_size, num_chunks, num_microbatches, forward_only) for r in range(pp_size)]
    last_stage = pp_size * num_chunks - 1
    done_at: dict[Message, int] = {}
    nxt = [0] * pp_size
    plans: list[list[Step]] = [[] for _ in range(pp_size)]
    t = 0
    while any(nxt[r] < len(orders[r]) for r in range(pp_size)):
        steps = [Step(None) for _ in range(pp_size)]
        ran = False
        for r in range(pp_size):
            if nxt[r] == len(orders[r]):
                continue
            op = orders[r][nxt[r]]
            need = _needs(op, r, pp_size, last_stage)
            if need is not None and done_at.get(need, t) >= t:
                continue  # its input arrives at the end of a later (or this) step: idle (bubble)
            steps[r].op = op
            nxt[r] += 1
            ran = True
        if not ran:
            raise RuntimeError(
                f"pipeline order for pp={pp_size}, chunks={num_chunks}, microbatches={num_microbatches} "
                f"cannot complete (ranks waiting at {nxt}); this is a bug in the schedule order"
            )
        for r in range(pp_size):
            op = steps[r].op
            out = None if op is None else _produces(op, r, pp_size, last_stage)
            if out is not None:
                peer, msg = out
                done_at[msg] = t
                steps[r].sends.append((peer, msg))
                steps[peer].recvs.append((r, msg))
        for r in range(pp_size):
            if steps[r].op is not None or steps[r].sends or steps[r].recvs:
                plans[r].append(steps[r])
        t += 1
    return tuple(tuple(p) for p in plans)
