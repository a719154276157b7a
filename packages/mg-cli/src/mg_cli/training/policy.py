"""When a run saves and when it stops: checkpoint interval, signals, time limit."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mg_cli.training.run import Run, layout_key
from mg_cli.training.signals import SAVE, STOP, SignalFlag, signal_name


class CheckpointPolicy:
    """Saves the run's state (each iteration at most once) and says so in one line on rank 0.

    Args:
        run: the run whose model, optimizer and RNG streams are saved.
        message: prints one line (rank 0's logger).
    """

    def __init__(self, run: Run, message: Any) -> None:
        self.run = run
        self.message = message
        self.saved_at: int | None = None

    def due(self, iteration: int) -> bool:
        """A periodic save (``checkpoint.interval``) falls on ``iteration`` (the last one saves anyway)."""
        c, iters = self.run.config.checkpoint, self.run.config.train.iters
        return bool(c.interval) and iteration % c.interval == 0 and iteration < iters

    def save(self, iteration: int, why: str = "") -> str | None:
        """Save after ``iteration``; returns the checkpoint directory, or None without ``checkpoint.save``.

        ``why`` (e.g. "stopping after iteration 7 on SIGTERM") starts the line that is printed.
        """
        from mg_cli.training import checkpointing

        run, c = self.run, self.run.config.checkpoint
        if c.save is None:
            if why:
                self.message(f"{why}; checkpoint.save is not set, nothing saved")
            return None
        path = f"{c.save}/iter_{iteration:07d}"
        if self.saved_at == iteration:
            if why:
                self.message(f"{why}; checkpoint {path} already saved")
            return path
        t = run.config.train
        extra = {
            "iteration": iteration,
            "consumed_samples": iteration * t.global_batch_size,
            "rng": checkpointing.gather_rng(run.rng),
            "layout_key": layout_key(run.grid, run.config),
            "config": run.config.to_dict(),
            "model_family": run.config.model.type,
            "model_config": run.model_config.to_dict(),
            "tokenizer_model": os.path.abspath(run.config.data.tokenizer_model),
            "data_format": run.config.data.format,
        }
        from mg_cli.training.families import family

        extra.update(family(run.config).checkpoint_extra(run.data.ds_config))  # e.g. T5's decoder start id
        if run.labels is not None:  # classification: what the head's outputs mean (mg convert writes id2label)
            extra["label_names"], extra["num_labels"] = run.labels
        checkpointing.save(run.saver, c.save, iteration, run.model, run.optimizer, run.grid, extra, async_save=c.async_,
                           keep_last=c.keep_last)
        self.saved_at = iteration
        self.message((f"{why}; saved" if why else "saved") + f" checkpoint {path}"
                     + (" (writing in the background)" if c.async_ else ""))
        return path


@dataclass
class StopDecision:
    """What every rank does after an iteration (the same on all: agreed with one all-reduce)."""

    request: int
    """signals.NONE, SAVE (save and continue) or STOP."""
    signum: int
    """The signal behind the request (0: none)."""
    timed_out: bool
    """``train.exit_after_minutes`` has passed (on some rank)."""


class StopConditions:
    """Signals and the time limit, checked once per iteration and agreed on by every rank."""

    def __init__(self, flag: SignalFlag, grid: Any, exit_after_minutes: float | None) -> None:
        self.flag, self.grid = flag, grid
        self.deadline = None if exit_after_minutes is None else time.monotonic() + 60 * exit_after_minutes
        # The ranks agree on the host (gloo, a CPU tensor), so the check never waits for an accelerator's queue.
        self.group = None
        if dist.is_initialized() and dist.get_backend() != "gloo":
            self.group = dist.new_group(backend="gloo")  # collective: every rank builds its StopConditions here

    def check(self) -> StopDecision:
        """One all-reduce on the host: the strongest request of any rank, its signal, and the time limit."""
        timed_out = self.deadline is not None and time.monotonic() > self.deadline
        values = [float(self.flag.request), float(self.flag.signum), float(timed_out)]
        if dist.is_initialized():
            t = torch.tensor(values)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            values = t.tolist()
        request, signum, timed = (int(v) for v in values)
        if request == SAVE:
            self.flag.clear_save()
        return StopDecision(request=request, signum=signum, timed_out=bool(timed))

    @staticmethod
    def describe(decision: StopDecision, iteration: int, exit_after_minutes: float | None) -> str:
        if decision.request == STOP:
            return f"stopping after iteration {iteration} on {signal_name(decision.signum)}"
        if decision.timed_out:
            return f"stopping after iteration {iteration} on train.exit_after_minutes={exit_after_minutes}"
        return f"{signal_name(decision.signum)} after iteration {iteration}: continuing"
