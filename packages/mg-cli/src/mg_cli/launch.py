"""Start ``mg train`` on several processes with PyTorch's elastic launcher, or join one.

``mg train --nproc-per-node N`` (the *wrapper*) starts PyTorch's launcher,
``torch.distributed.run``, through this module's :func:`main` (``python -m mg_cli.launch``),
which forks the N workers (torch, imported by the launcher, is not imported again per worker; each
names itself ``mg-rank<R>``). The launcher starts while the wrapper still checks the config and waits
for its ``go`` (:data:`GATE_FD`). A process that is already a worker (started by ``torchrun``, by
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

Failures end the job with one line, printed once by the launcher after every worker has stopped:
a worker that stops with a one-line error (a ``click.ClickException``, as ``Error: ...`` from one
process) records it in the status directory instead of printing it, and the launcher prints the
earliest recorded one in place of torch's failure report; several ranks failing alike print it
once. A worker that dies without one (killed by a signal, or a crash whose traceback it prints)
gets a line naming its rank. A worker's exception that follows another rank's recorded error
(a collective whose peer has gone) is not printed: the recorded error is its cause.

Every process of the job carries ``MG_RUN_ID`` in its environment.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

RUN_ID = "MG_RUN_ID"
"""Environment marker carried by every process of a job started by ``mg train``."""
STATUS_DIR = "MG_RUN_STATUS_DIR"
"""Directory where each worker records that it ended cleanly (``local<LOCAL_RANK>.json``) or the one-line error it
stopped with (``error<LOCAL_RANK>.json``)."""
PARENT_PID = "MG_PARENT_PID"
"""Pid the launcher (set by the wrapper) or a worker (set by the launcher) must die with."""
GATE_FD = "MG_LAUNCH_GATE_FD"
"""File descriptor on which the launcher reads ``go`` from the wrapper before it starts workers."""
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
    argv: list[str], *, nproc_per_node: int, nnodes: int, node_rank: int, master_addr: str | None, master_port: int | None,
    preflight: Callable[[], None] | None = None,
) -> int:
    """Run ``mg <argv>`` on ``nproc_per_node`` local processes (x ``nnodes``) via torch.distributed.run.

    ``preflight`` (checks that raise before any worker starts) runs here while the launcher imports torch; the
    launcher waits for its outcome and starts no worker when it raises (the exception propagates).
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
        gate_read, gate = os.pipe()
        env[GATE_FD] = str(gate_read)
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, pass_fds=(gate_read,))
        os.close(gate_read)
        try:
            if preflight is not None:
                preflight()
            os.write(gate, b"go")
        except BaseException:
            proc.kill()  # it has started no worker yet: it waits on the gate
            proc.wait()
            raise
        finally:
            os.close(gate)

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


def _status_dir() -> Path | None:
    """The job's status directory when this process belongs to a job started by ``mg`` (else None)."""
    status_dir = os.environ.get(STATUS_DIR)
    return Path(status_dir) if status_dir is not None and os.path.isdir(status_dir) else None


def _write_record(status_dir: Path, name: str, record: dict[str, Any]) -> None:
    """Write ``record`` as ``status_dir/name`` atomically (the launcher never reads half a file)."""
    tmp = status_dir / f".{name}.tmp"
    tmp.write_text(json.dumps(record))
    tmp.replace(status_dir / name)


def report_clean_end(iteration: int, saved: str | None, signum: int) -> None:
    """Record in the job's status directory that this rank ended cleanly: finished, or saved and stopped
    after signal ``signum`` (no-op outside a job started by ``mg train``)."""
    status_dir = _status_dir()
    if status_dir is None:
        return
    local_rank = os.environ.get("LOCAL_RANK", "0")
    record = {"rank": int(os.environ.get("RANK", "0")), "iteration": iteration, "saved": saved, "signal": signum}
    _write_record(status_dir, f"local{local_rank}.json", record)


def report_error(message: str) -> bool:
    """Record in the job's status directory the one-line error this rank stops with, for the launcher to print
    once for the whole job after every worker has stopped.

    Returns:
        True when recorded; False outside a job started by ``mg`` (the caller prints the error itself).
    """
    status_dir = _status_dir()
    if status_dir is None:
        return False
    local_rank = os.environ.get("LOCAL_RANK", "0")
    record = {"rank": int(os.environ.get("RANK", "0")), "message": message, "time": time.time()}
    _write_record(status_dir, f"error{local_rank}.json", record)
    return True


def _reported_errors() -> list[dict[str, Any]]:
    """The errors this node's workers recorded, earliest first (ties: lowest rank)."""
    status_dir = _status_dir()
    records = []
    for path in status_dir.glob("error*.json") if status_dir is not None else ():
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(records, key=lambda r: (r["time"], r["rank"]))


def _clean_stops(nproc: int) -> tuple[list[int], list[int]]:
    """Local ranks that recorded a clean end, and those that did not."""
    status_dir = Path(os.environ.get(STATUS_DIR, "/nonexistent"))
    clean = [r for r in range(nproc) if (status_dir / f"local{r}.json").is_file()]
    return clean, [r for r in range(nproc) if r not in clean]


def _children(parent: int) -> list[tuple[int, str, str]]:
    """``(pid, state, name)`` of every process whose parent is ``parent`` (from Linux's ``/proc``; empty elsewhere)."""
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError, IndexError):
            continue
        if int(ppid) == parent:
            out.append((int(entry), state, name))
    return out


def _forward_to_children(signum: int, frame: Any) -> None:
    """Pass a signal the elastic launcher does not handle (SIGUSR1) on to this process's children, the workers."""
    for pid, _, _ in _children(os.getpid()):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _peer_ended_unreported() -> bool:
    """Whether another worker of this node has ended (or is ending) without recording an error or a clean end
    (killed, crashed).

    The workers are the launcher's children named ``mg-rank<RANK>``; this node's ranks are ``LOCAL_WORLD_SIZE``
    consecutive ones.
    """
    launcher, local_world = os.environ.get(PARENT_PID), os.environ.get("LOCAL_WORLD_SIZE")
    status_dir = _status_dir()
    if launcher is None or local_world is None or status_dir is None:
        return False
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    alive = {rank}
    for _, state, name in _children(int(launcher)):
        if name.startswith("mg-rank") and name[7:].isdigit() and state not in "ZXx":
            alive.add(int(name[7:]))
    ended = set(range(rank - local_rank, rank - local_rank + int(local_world))) - alive
    recorded = {rank - local_rank + int(path.stem[5:]) for path in status_dir.glob("local*.json")}
    recorded |= {r["rank"] for r in _reported_errors()}
    return bool(ended - recorded)


def _wait_to_be_stopped() -> None:
    """Wait, at most 5 s, for the launcher to stop this worker: the launcher then sees the peer that ended first
    end first, and names it."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher's SIGTERM ends the wait
    time.sleep(5.0)


def _follows_peer_failure(grace_s: float) -> bool:
    """Whether this worker's failure follows another worker's on this node, checked for up to ``grace_s`` seconds
    (the peer may still be exiting): one that recorded an error (the launcher prints it), or one that ended without
    (then this worker waits to be stopped, see :func:`_wait_to_be_stopped`)."""
    rank = int(os.environ.get("RANK", "0"))
    deadline = time.monotonic() + grace_s
    while True:
        if _peer_ended_unreported():
            _wait_to_be_stopped()
            return True
        if any(r["rank"] != rank for r in _reported_errors()):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _run_command(argv: list[str]) -> int:
    """``mg <argv>`` as a worker: returns its exit status.

    A one-line error (``click.ClickException``) is recorded for the launcher to print once (:func:`report_error`);
    an unexpected exception prints its traceback. Neither is reported when it follows another worker's failure
    (:func:`_follows_peer_failure`: a collective whose peer has gone fails too).
    """
    import traceback

    import click

    from mg_cli.main import cli

    try:
        rv = cli.main(args=argv, prog_name="mg", standalone_mode=False)
    except click.UsageError as e:
        e.show()
        return e.exit_code
    except click.ClickException as e:
        if _peer_ended_unreported():
            _wait_to_be_stopped()
        elif not report_error(e.format_message()):
            e.show()
        return e.exit_code
    except click.Abort:
        click.echo("Aborted!", err=True)
        return 1
    except Exception:  # noqa: BLE001 - a crash prints its traceback unless another worker's failure caused it
        if not _follows_peer_failure(0.5):
            traceback.print_exc()
        return 1
    return rv if isinstance(rv, int) else 0  # click returns the code of an explicit ctx.exit(code)


def _forked_worker(*cmd_args: str) -> int:
    """A worker forked from the launcher: ``mg <argv>`` where ``cmd_args`` is the launcher's command after the
    interpreter (``-u -m mg_cli.main <argv>``). Returns 0 when it ends with exit status 0; exits with any other."""
    import threading

    argv = list(cmd_args[cmd_args.index("mg_cli.main") + 1 :])
    try:  # `ps` and `top` tell the ranks apart (the forks share the launcher's command line)
        with open("/proc/self/comm", "w") as comm:
            comm.write(f"mg-rank{os.environ.get('RANK', '')}")
    except OSError:
        pass
    for sig in (*FORWARDED, signal.SIGHUP, signal.SIGQUIT):  # the launcher's handlers are not a worker's
        signal.signal(sig, signal.SIG_DFL)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # as the interpreter's -u: lines reach the terminal as they come
    sys.argv = ["mg", *argv]
    code = _run_command(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        raise SystemExit(code)
    # The launcher reads the return value and lets the process end; a launcher that is shutting down (after a
    # signal) never does, so the process ends by itself a moment later.
    ender = threading.Timer(1.0, os._exit, (0,))
    ender.daemon = True
    ender.start()
    return 0


def _run_forked(parsed: Any) -> None:
    """``torch.distributed.run.run(parsed)``, with the workers forked from this process instead of started as new
    interpreters: torch is imported once per node, not once per worker (seconds of CPU each). This process never
    touches an accelerator, so the forks may initialise theirs."""
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    if parsed.standalone:  # what torch.distributed.run does for --standalone
        parsed.rdzv_backend, parsed.rdzv_endpoint, parsed.rdzv_id = "c10d", "localhost:0", uuid.uuid4().hex
    config, _, cmd_args = config_from_args(parsed)
    config.start_method = "fork"
    elastic_launch(config=config, entrypoint=_forked_worker)(*cmd_args)


def main(args: list[str] | None = None) -> int:
    """``python -m mg_cli.launch TORCHRUN_ARGS``: ``torch.distributed.run`` with mg's signal handling.

    Returns the exit code: 0 on success or a clean signal-driven stop of every local worker;
    1 otherwise, after one line saying what went wrong (no traceback): the error the workers stopped with,
    printed once, or the rank that died without one.
    """
    args = list(sys.argv[1:] if args is None else args)
    die_with_parent(signal.SIGTERM)
    os.environ[PARENT_PID] = str(os.getpid())  # the workers die with this process
    signal.signal(signal.SIGUSR1, _forward_to_children)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(args)
    if GATE_FD in os.environ:  # the wrapper's checks ran while torch was imported above
        gate = int(os.environ.pop(GATE_FD))
        go = os.read(gate, 2) == b"go"
        os.close(gate)
        if not go:
            return 0
    _quiet_launcher_logs()
    try:
        _run_forked(parsed)
    except SignalException as e:
        nproc = int(str(parsed.nproc_per_node))
        clean, failed = _clean_stops(nproc)
        if failed:
            print(f"mg train: stopped on {signal.Signals(e.sigval).name}; local ranks {failed} did not save and "
                  f"stop cleanly", file=sys.stderr, flush=True)
            errors = _reported_errors()
            if errors:
                print(f"Error: {errors[0]['message']}", file=sys.stderr, flush=True)
            return 1
        return 0
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        print(_failure_line(rank, failure.pid, failure.exitcode, _reported_errors()), file=sys.stderr, flush=True)
        return 1
    return 0


def _failure_line(rank: int, pid: int, exitcode: int, errors: list[dict[str, Any]]) -> str:
    """The one line that ends a failed job: the earliest error a worker recorded, unless the first rank seen to fail
    (``rank``, process ``pid``) was killed by a signal (then its rank and the signal), or a line naming the rank
    when none was recorded (its traceback, if any, is above)."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"Error: rank {rank} (pid {pid}) was killed by {name}"
    if errors:
        return f"Error: {errors[0]['message']}"
    return f"Error: rank {rank} (pid {pid}) exited with code {exitcode}; its output above says why"


def _quiet_launcher_logs() -> None:
    """Keep the launcher's own log lines off the terminal: its progress messages ("Sending process ... closing
    signal", every worker says what it did) and its report of a worker's failure with the launcher's traceback
    (:func:`main` prints one line in its place); its other errors (a worker stuck in the kernel) stay."""
    import logging

    from torch.multiprocessing.spawn import ProcessException

    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if name.startswith("torch.distributed") and isinstance(logger, logging.Logger):
            logger.setLevel(logging.ERROR)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # "Terminating process ... SIGTERM"

    def not_a_worker_failure(record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], ProcessException))

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(not_a_worker_failure)


if __name__ == "__main__":
    sys.exit(main())
