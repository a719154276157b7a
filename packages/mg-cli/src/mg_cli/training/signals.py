"""Signals to a training process: what they ask for, recorded until the ranks agree on it.

SIGTERM and SIGINT ask the run to save and stop; SIGUSR1 (Slurm's ``--signal=USR1@90``, sent
ahead of the time limit) asks it to save and then stop or continue, as ``checkpoint.on_signal``
says. A handler only records the request: the training loop reads it once per iteration, all
ranks agree on the strongest request with one all-reduce, and every rank acts on the same
iteration. No torch import here, so the flag can be installed before the heavy imports.
"""

from __future__ import annotations

import signal
from typing import Any

NONE, SAVE, STOP = 0, 1, 2
"""Requests, ordered so that the maximum over ranks is the one to act on."""

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class SignalFlag:
    """Records SIGTERM/SIGINT (stop) and SIGUSR1 (save, then stop or continue) for the training loop.

    Args:
        usr1_continues: SIGUSR1 saves and continues (``checkpoint.on_signal: save_and_continue``)
            instead of saving and stopping.
    """

    def __init__(self, *, usr1_continues: bool = False) -> None:
        self.usr1_continues = usr1_continues
        self.request = NONE
        self.signum = 0
        self._old: dict[int, Any] = {}

    def install(self) -> SignalFlag:
        """Take over the handled signals (main thread only); returns self."""
        for sig in HANDLED:
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        """Give the signals back to their previous handlers."""
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        request = SAVE if signum == signal.SIGUSR1 and self.usr1_continues else STOP
        if request >= self.request:
            self.request, self.signum = request, signum

    def clear_save(self) -> None:
        """Forget a save-and-continue request once acted on (a stop request stays)."""
        if self.request == SAVE:
            self.request, self.signum = NONE, 0


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15, etc."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
