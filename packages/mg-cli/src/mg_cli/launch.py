"""Start ``mg train`` on several processes with PyTorch's elastic launcher, or join one.

``mg train --nproc-per-node N`` (the *wrapper*) starts PyTorch's launcher,
``torch.distributed.run``, through this module's :func:`main` (``python -m mg_cli.launch``),
which starts the N workers. A process that is already a worker (started by ``torchrun``, by
``mg`` itself, or by Slurm's ``srun``) just runs. We never implement our own launcher or
rendezvous; this module only makes signals and deaths travel through the three levels:

* The wrapper forwards SIGTERM, SIGINT and SIGUSR1 to the launcher and exits with its status.
  The launcher runs in a session of its own (a Ctrl-C on the terminal reaches the wrapper
  only, which forwards it once).
* The launcher dies with the wrapper: it asks the kernel for SIGTERM when its parent dies
  (``prctl(PR_SET_PDEATHSIG)``), so killing the wrapper even with SIGKILL stops the job the
  graceful way. SIGTERM/SIGINT make ``torch.distributed.run`` pass the signal to every worker and
  wait for them (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds, 300 by default here, then SIGKILL);
  SIGUSR1 is passed to the workers by this module.
* Each worker likewise dies with the launcher (SIGTERM on its death), saves at an iteration
  every rank agrees on, stops, and records that it did in the job's status directory, so the
  launcher can tell a clean signal-driven stop (exit 0) from a failed one (exit 1).

Every process of the job carries ``MG_RUN_ID`` in its environment.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

RUN_ID = "MG_RUN_ID"
"""Environment marker carried by every process of a job started by ``mg train``."""
STATUS_DIR = "MG_RUN_STATUS_DIR"
"""Directory where each worker records that it ended cleanly (``local<LOCAL_RANK>.json``)."""
PARENT_PID = "MG_PARENT_PID"
"""Pid the launcher (set by the wrapper) or a worker (set by the launcher) must die with."""
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
_PR_SET_PDEATHSIG = 1


def launch_id() -> str | None:
    """The run id ``mg train``'s own launch gave this job (None when started otherwise)."""
    return os.environ.get(RUN_ID)


def under_launcher() -> bool:
    """True when this process is already one rank of a launched job."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def adopt_slurm_env() -> bool:
    """Map Slurm's task variables onto torch.distributed's when started by ``srun`` directly.

    MASTER_ADDR/MASTER_PORT must be exported by the batch script (e.g. the first host of
    ``scontrol show hostnames $SLURM_JOB_NODELIST``). Returns True when Slurm variables were used.
    """
    if under_launcher() or "SLURM_PROCID" not in os.environ or "SLURM_NTASKS" not in os.environ:
        return False
    if int(os.environ["SLURM_NTASKS"]) <= 1:
        return False
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    os.environ.setdefault("MASTER_PORT", "29500")
    if "MASTER_ADDR" not in os.environ:
        raise SystemExit(
            "error: started by srun without MASTER_ADDR; export MASTER_ADDR (first node's host) in the batch script"
        )
    return True


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` to this process when the process named by ``MG_PARENT_PID`` dies.

    Linux only (``prctl(PR_SET_PDEATHSIG)``); elsewhere a no-op returning False. When the parent
    is already gone (it died while this process started), ``sig`` is raised at once.
    """
    expected = os.environ.get(PARENT_PID)
    if expected is None or not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if str(os.getppid()) != expected:
        os.kill(os.getpid(), sig)
    return True


def relaunch(
    argv: list[str], *, nproc_per_node: int, nnodes: int, node_rank: int, master_addr: str | None, master_port: int | None
) -> int:
    """Run ``mg <argv>`` on ``nproc_per_node`` local processes (x ``nnodes``) via torch.distributed.run.

    Forwards SIGTERM, SIGINT and SIGUSR1 to the launcher while it runs.

    Returns:
        The launcher's exit code: 0 when the run finished, or every rank saved and stopped after a
        signal; non-zero when any rank failed (the launcher stops the rest) or did not stop cleanly.
    """
    cmd = [sys.executable, "-m", "mg_cli.launch", f"--nproc-per-node={nproc_per_node}", "--max-restarts=0"]
    if nnodes == 1 and master_addr is None:
        cmd.append("--standalone")
    else:
        cmd += [
            f"--nnodes={nnodes}",
            f"--node-rank={node_rank}",
            f"--master-addr={master_addr or '127.0.0.1'}",
            f"--master-port={master_port or 29500}",
        ]
    cmd += ["-m", "mg_cli.main", *argv]
    with tempfile.TemporaryDirectory(prefix="mg-run-") as status_dir:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault(RUN_ID, uuid.uuid4().hex)
        env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "300")
        env[STATUS_DIR] = status_dir
        env[PARENT_PID] = str(os.getpid())
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)

        def forward(signum: int, frame: Any) -> None:
            if proc.poll() is None:
                proc.send_signal(signum)

        old = {sig: signal.signal(sig, forward) for sig in FORWARDED}
        try:
            code = proc.wait()
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
    return code if code >= 0 else 128 - code


def report_clean_end(iteration: int, saved: str | None, signum: int) -> None:
    """Record in the job's status directory that this rank ended cleanly: finished, or saved and stopped
    after signal ``signum`` (no-op outside a job started by ``mg train``)."""
    status_dir = os.environ.get(STATUS_DIR)
    if status_dir is None or not os.path.isdir(status_dir):
        return
    local_rank = os.environ.get("LOCAL_RANK", "0")
    record = {"rank": int(os.environ.get("RANK", "0")), "iteration": iteration, "saved": saved, "signal": signum}
    tmp = Path(status_dir) / f".local{local_rank}.json.tmp"
    tmp.write_text(json.dumps(record))
    tmp.replace(Path(status_dir) / f"local{local_rank}.json")


def _clean_stops(nproc: int) -> tuple[list[int], list[int]]:
    """Local ranks that recorded a clean end, and those that did not."""
    status_dir = Path(os.environ.get(STATUS_DIR, "/nonexistent"))
    clean = [r for r in range(nproc) if (status_dir / f"local{r}.json").is_file()]
    return clean, [r for r in range(nproc) if r not in clean]


def _forward_to_children(signum: int, frame: Any) -> None:
    """Pass a signal the elastic launcher does not handle (SIGUSR1) on to this process's children, the workers."""
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == me:
            try:
                os.kill(int(entry), signum)
            except ProcessLookupError:
                pass


def main(args: list[str] | None = None) -> int:
    """``python -m mg_cli.launch TORCHRUN_ARGS``: ``torch.distributed.run`` with mg's signal handling.

    Returns the exit code: 0 on success or a clean signal-driven stop of every local worker;
    1 otherwise, after one line saying what went wrong (no traceback).
    """
    import logging

    args = list(sys.argv[1:] if args is None else args)
    die_with_parent(signal.SIGTERM)
    os.environ[PARENT_PID] = str(os.getpid())  # the workers die with this process
    signal.signal(signal.SIGUSR1, _forward_to_children)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as elastic_run

    parsed = get_args_parser().parse_args(args)
    # The launcher's own progress messages ("Sending process ... closing signal") are noise here:
    # every worker says what it did.
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if name.startswith("torch.distributed") and isinstance(logger, logging.Logger):
            logger.setLevel(logging.ERROR)
    try:
        elastic_run(parsed)
    except SignalException as e:
        nproc = int(str(parsed.nproc_per_node))
        clean, failed = _clean_stops(nproc)
        if failed:
            print(f"mg train: stopped on {signal.Signals(e.sigval).name}; local ranks {failed} did not save and "
                  f"stop cleanly", file=sys.stderr, flush=True)
            return 1
        return 0
    except ChildFailedError as e:
        print(e.format_msg(), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
