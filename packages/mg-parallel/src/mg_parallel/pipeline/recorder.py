"""Recording when each forward and backward pass of a pipeline schedule ran."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Recorder", "ScheduleEvent", "ScheduleRecorder"]

Recorder = Callable[[int, int, int, str, float, float], None]
"""``recorder(pp_rank, chunk, microbatch, kind, t_start, t_end)``; kind is ``"F"`` or ``"B"``,
times are ``time.time()`` seconds (comparable across processes on one host)."""


@dataclass(frozen=True)
class ScheduleEvent:
    """One executed pass: pipeline rank, model chunk, microbatch, ``"F"``/``"B"``, start/end (s)."""

    pp_rank: int
    chunk: int
    microbatch: int
    kind: str
    t_start: float
    t_end: float


@dataclass
class ScheduleRecorder:
    """A ready-made ``recorder`` callback: appends every pass to :attr:`events` in execution order.

    Pass it as ``recorder=`` to a schedule; send ``events`` (plain dataclasses) to one rank to
    plot the executed schedule (see ``benchmarks/plot_schedule.py``).
    """

    events: list[ScheduleEvent] = field(default_factory=list)

    def __call__(self, pp_rank: int, chunk: int, microbatch: int, kind: str, t_start: float, t_end: float) -> None:
        self.events.append(ScheduleEvent(pp_rank, chunk, microbatch, kind, t_start, t_end))

    def order(self) -> list[tuple[str, int, int]]:
        """The executed ``(kind, chunk, microbatch)`` sequence."""
        return [(e.kind, e.chunk, e.microbatch) for e in self.events]
