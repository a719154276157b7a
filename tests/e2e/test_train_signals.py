"""Signals through `mg train --nproc-per-node N`: wrapper -> torch.distributed.run -> workers.

Each signal-driven stop must save one complete checkpoint at an iteration every rank agrees on,
exit 0 within 60 s without a traceback, leave no process of the job behind (found by the
``MG_RUN_ID`` marker every process of the job carries), and resume at the next iteration with
the uninterrupted run's losses, bit for bit at the same layout.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import time
import uuid
from pathlib import Path

import pytest

from tests.e2e.conftest import (
    mg,
    mg_start,
    processes_with_marker,
    read_checkpoint,
    read_metrics,
    tiny_args,
    train_losses,
)

LAYOUTS = {
    # name: (processes, --set overrides; the same tuples as test_train_layouts, so the runs are shared)
    "tp2": (2, ("parallel.tp=2",)),
    "pp2-dp2-distopt": (4, ("parallel.pp=2", "parallel.distributed_optimizer=true")),
}
STOP_LINE = re.compile(r"stopping after iteration (\d+) on (SIG\w+); saved checkpoint (\S+)")


class Job:
    """`mg train` started as a user would, in a session of its own, with a marker in its environment."""

    def __init__(self, corpus: dict, root: Path, nproc: int, sets: tuple[str, ...], *extra: str) -> None:
        self.log, self.ckpt, self.marker = root / "log", root / "ckpt", uuid.uuid4().hex
        # The schedule is pinned to the 20-iteration reference's; the run itself would go on for long.
        args = tiny_args(corpus, self.log, f"checkpoint.save={self.ckpt}", "optim.decay_iters=20", *sets, *extra,
                         iters=1000)
        self.out_path = root / "out.txt"
        self.proc = mg_start(*args, "--nproc-per-node", str(nproc), stdout=self.out_path,
                             env={"MG_RUN_ID": self.marker})

    def wait_for_iterations(self, n: int, timeout: float = 300) -> int:
        """Block until ``n`` iterations are logged (more may be); returns the number logged."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (self.log / "metrics.jsonl").exists():
                done = len(train_losses(self.log))
                if done >= n:
                    return done
            assert self.proc.poll() is None, f"mg train exited early ({self.proc.returncode}):\n{self.output()[-3000:]}"
            time.sleep(0.2)
        raise AssertionError(f"fewer than {n} iterations after {timeout} s:\n{self.output()[-3000:]}")

    def pid_of(self, target: str) -> int:
        """The wrapper, the launcher (torch.distributed.run) or the worker with LOCAL_RANK=1."""
        if target == "wrapper":
            return self.proc.pid
        for pid in processes_with_marker(self.marker):
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
                name = open(f"/proc/{pid}/comm").read().strip()  # the workers are forks of the launcher, named by rank
            except OSError:
                continue
            if target == "launcher" and b"mg_cli.launch" in cmdline and not name.startswith("mg-rank"):
                return pid
            if target == "worker" and name == "mg-rank1":
                return pid
        raise AssertionError(f"no {target} process found for the job")

    def stop_with(self, sig: int, target: str = "wrapper", *, after: int = 3, timeout: float = 60) -> tuple[int, float]:
        """Send ``sig`` to ``target`` once ``after`` iterations are logged; ``(exit code, seconds to exit)``."""
        try:
            self.wait_for_iterations(after)
            os.kill(self.pid_of(target), sig)
            start = time.monotonic()
            code = self.finish(timeout=timeout)
            return code, time.monotonic() - start
        finally:
            self.kill()

    def finish(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        for pid in processes_with_marker(self.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def output(self) -> str:
        return self.proc.read_stdout()


def assert_no_survivors(job: Job, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while processes_with_marker(job.marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_with_marker(job.marker), f"processes of the job survived: {processes_with_marker(job.marker)}"


def assert_clean_stop(job: Job, out: str, sig: str) -> int:
    """The one line rank 0 prints, no traceback, and a complete checkpoint at the iteration it names."""
    assert "Traceback" not in out and "Error" not in out, out[-3000:]
    stops = STOP_LINE.findall(out)
    assert len(stops) == 1 and stops[0][1] == sig, out[-3000:]
    stopped_at = int(stops[0][0])
    # Nothing but iteration lines (rank 0's progress) after the start, then that one line.
    tail = out[out.index("\ncheckpoint:"):].splitlines()
    others = [line for line in tail if line.strip() and not line.startswith(("iteration ", " ", "checkpoint:", "log:"))]
    assert others == [f"stopping after iteration {stopped_at} on {sig}; saved checkpoint "
                      f"{job.ckpt}/iter_{stopped_at:07d}"], others
    assert max(train_losses(job.log)) == stopped_at
    assert (job.ckpt / "latest").read_text().strip() == str(stopped_at)
    assert {p.name for p in job.ckpt.iterdir()} == {"latest", f"iter_{stopped_at:07d}"}
    assert read_checkpoint(job.ckpt / f"iter_{stopped_at:07d}", "model/")  # every file's checksum verified
    return stopped_at


# Each way in once: the launcher (where a scheduler's signal lands) and one worker at the 4-process layout (sharded
# optimizer state, two pipeline stages), the wrapper at tp2.
@pytest.mark.parametrize(("layout", "target"), [("pp2-dp2-distopt", "launcher"), ("pp2-dp2-distopt", "worker"),
                                                ("tp2", "wrapper")])
def test_sigterm_saves_stops_and_resumes_exactly(layout, target, corpus, layout_runs, tmp_path):
    nproc, sets = LAYOUTS[layout]
    ref_log, _, _ = layout_runs.get(nproc, sets)
    ref = train_losses(ref_log)
    job = Job(corpus, tmp_path, nproc, sets)
    code, took = job.stop_with(signal.SIGTERM, target)
    out = job.output()
    assert code == 0, out[-3000:]
    assert took < 60
    assert_no_survivors(job)
    stopped_at = assert_clean_stop(job, out, "SIGTERM")
    assert stopped_at <= 17, f"stopped at {stopped_at}: too late to compare with the 20-iteration reference"
    for it in range(1, stopped_at + 1):
        assert train_losses(job.log)[it] == ref[it], f"iteration {it} before the signal differs"
    # Resume at the next iteration: the uninterrupted run's losses, bit for bit.
    mg(*tiny_args(corpus, tmp_path / "resumed", f"checkpoint.save={job.ckpt}", "optim.decay_iters=20", *sets,
                  iters=stopped_at + 3), "--resume", "--nproc-per-node", str(nproc))
    resumed = train_losses(tmp_path / "resumed")
    assert sorted(resumed) == [stopped_at + 1, stopped_at + 2, stopped_at + 3]
    for it, loss in resumed.items():
        assert loss == ref[it], f"iteration {it}: {loss!r} != {ref[it]!r}"


def test_sigkill_to_the_wrapper_leaves_no_process(corpus, tmp_path):
    """The launcher dies with the wrapper (PR_SET_PDEATHSIG -> SIGTERM), so the workers still save and stop."""
    job = Job(corpus, tmp_path, 2, ("parallel.tp=2",))
    try:
        job.wait_for_iterations(3)
        os.kill(job.proc.pid, signal.SIGKILL)
        job.proc.wait(timeout=10)
        assert_no_survivors(job, within=60)
    finally:
        job.kill()
    stopped_at = int((job.ckpt / "latest").read_text())
    assert read_checkpoint(job.ckpt / f"iter_{stopped_at:07d}", "model/")


def test_sigusr1_save_and_continue_then_sigint_stops(corpus, tmp_path):
    """checkpoint.on_signal=save_and_continue: SIGUSR1 saves and training goes on; Ctrl-C (SIGINT) then stops."""
    job = Job(corpus, tmp_path, 2, ("parallel.tp=2",), "checkpoint.on_signal=save_and_continue")
    try:
        job.wait_for_iterations(3)
        os.kill(job.proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 60
        while not (job.ckpt / "latest").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        saved_at = int((job.ckpt / "latest").read_text())
        job.wait_for_iterations(saved_at + 3)  # still training
        os.kill(job.proc.pid, signal.SIGINT)
        code = job.finish(timeout=60)
    finally:
        job.kill()
    out = job.output()
    assert code == 0, out[-3000:]
    assert f"SIGUSR1 after iteration {saved_at}: continuing; saved checkpoint {job.ckpt}/iter_{saved_at:07d}" in out
    stops = STOP_LINE.findall(out)
    assert len(stops) == 1 and stops[0][1] == "SIGINT" and int(stops[0][0]) >= saved_at + 3, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert_no_survivors(job)
    assert {p.name for p in job.ckpt.iterdir()} == {"latest", f"iter_{saved_at:07d}", f"iter_{int(stops[0][0]):07d}"}


def test_sigusr1_saves_and_stops_by_default(corpus, tmp_path):
    job = Job(corpus, tmp_path, 2, ("parallel.tp=2",))
    code, _ = job.stop_with(signal.SIGUSR1)
    out = job.output()
    assert code == 0, out[-3000:]
    assert_no_survivors(job)
    assert_clean_stop(job, out, "SIGUSR1")
    assert read_metrics(job.log)


def test_slurm_tasks_save_and_stop_on_usr1(corpus, tmp_path):
    """Slurm's way: `srun` starts every task itself (SLURM_PROCID/SLURM_NTASKS, no launcher) and
    `--signal=USR1@90` signals every task; the job saves once and each task exits 0."""
    log, ckpt, marker = tmp_path / "log", tmp_path / "ckpt", uuid.uuid4().hex
    args = tiny_args(corpus, log, f"checkpoint.save={ckpt}", "parallel.tp=2", iters=1000)
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    tasks = []
    for rank in range(2):
        env = {"MG_RUN_ID": marker, "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        tasks.append(mg_start(*args, stdout=tmp_path / f"task{rank}.txt", env=env))
    try:
        deadline = time.monotonic() + 300
        while not ((log / "metrics.jsonl").exists() and len(train_losses(log)) >= 3):
            assert time.monotonic() < deadline and all(t.poll() is None for t in tasks), "training never started"
            time.sleep(0.2)
        for t in tasks:
            t.send_signal(signal.SIGUSR1)
        outs = [t.communicate(timeout=60)[0] for t in tasks]
    finally:
        for pid in processes_with_marker(marker):
            os.kill(pid, signal.SIGKILL)
    assert [t.returncode for t in tasks] == [0, 0], outs
    assert all("Traceback" not in out for out in outs), outs
    stops = STOP_LINE.findall(outs[0])
    assert len(stops) == 1 and stops[0][1] == "SIGUSR1", outs[0][-2000:]
    assert not STOP_LINE.findall(outs[1])  # rank 1 prints nothing of its own
    stopped_at = int(stops[0][0])
    assert (ckpt / "latest").read_text().strip() == str(stopped_at)
    assert read_checkpoint(ckpt / f"iter_{stopped_at:07d}", "model/")
