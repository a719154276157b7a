"""Running generated programs: a subprocess per program, a fresh temporary directory, a time limit.

This is containment against accidents (a loop that never ends, a stray file write, a forked process
left behind), not a security sandbox: generated code runs with the user's permissions, which is why
``mg eval`` runs it only with ``--allow-code-execution``. Programs get an isolated interpreter
(``python -I``: no user site, no ``PYTHON*`` variables, the script's directory not on the path), an
environment without proxy settings, no standard input, their own session (so the whole process group,
whatever the program forked, is killed when it ends or runs out of time) and, where the platform has
``resource``, a 4 GiB address-space limit. The limit is set by the child interpreter itself before it
runs the program (no ``preexec_fn``, which is unsafe in a process with threads).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

__all__ = ["CodeExecutionRefused", "run_program"]

MEMORY_LIMIT_BYTES = 4 << 30

# Run as ``python -I -c _LAUNCHER PROGRAM LIMIT``: limit the address space, then run PROGRAM as __main__.
_LAUNCHER = """\
import runpy, sys
try:
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[2]), int(sys.argv[2])))
except (ImportError, ValueError, OSError):
    pass
sys.argv = sys.argv[1:2]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class CodeExecutionRefused(ValueError):
    """Code would run (a humaneval task's programs, a harness task's Python) without ``--allow-code-execution``."""

    def __init__(self, path: str, reason: str = "humaneval runs the programs the model writes, which are "
                                                "untrusted code") -> None:
        super().__init__(f"{path}: {reason}; pass --allow-code-execution to run it")


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_unreaped(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for ``proc`` to exit without reaping it (so its pid, the process group's id,
    cannot be reused before the group is killed); False on timeout."""
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while True:
        try:
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.05)


def run_program(source: str, timeout_s: float) -> bool:
    """True when ``source`` runs to exit status 0 within ``timeout_s`` seconds in a fresh directory.

    On return, the program and every process it started in its session are gone (killed with its
    process group, whether it exited or ran out of time).
    """
    env = {"PATH": os.environ.get("PATH", ""), "HOME": "", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
    with tempfile.TemporaryDirectory(prefix="mg-eval-") as tmp:
        path = os.path.join(tmp, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(source)
        env["HOME"] = env["TMPDIR"] = tmp
        proc = subprocess.Popen([sys.executable, "-I", "-c", _LAUNCHER, path, str(MEMORY_LIMIT_BYTES)], cwd=tmp,
                                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            if hasattr(os, "waitid"):
                finished = _wait_unreaped(proc, timeout_s)
            else:  # no waitid: reap, then kill what is left of the group
                try:
                    proc.wait(timeout_s)
                    finished = True
                except subprocess.TimeoutExpired:
                    finished = False
        finally:
            _kill_group(proc.pid)  # its own session: the group id is its pid
            proc.wait()
        return finished and proc.returncode == 0
