"""Run ``python -m mg_cli.main ARGS`` without paying the interpreter's start-up each time.

A server process imports torch and mg once, then forks one child per command. Each child is a process of its own
(own pid and session, own environment, working directory, stdout and stderr, exit status), exactly what
``subprocess.Popen([sys.executable, "-m", "mg_cli.main", ...], start_new_session=True)`` gives, minus the ~2 s of
imports. :meth:`Zygote.popen` returns at once with a handle used as a ``Popen`` is (``pid``, ``poll``, ``wait``,
``send_signal``, ``kill``, ``returncode``, ``communicate``), so several commands can run at once (two nodes, the
ranks of a job) and a test can watch, signal or kill one while it runs; :meth:`Zygote.run` runs one to its end.

What differs from a new interpreter:

* a module imported by the server read its environment variables then, so a command whose environment must
  change how torch or mg import (none of the suite's do) is run as a plain subprocess (``mg(..., fresh=True)``);
* the command's own ``sys.stdout`` and ``sys.stderr`` are unbuffered (the server's, as ``PYTHONUNBUFFERED=1``
  makes them; ``mg()`` sets it for every command anyway);
* ``/proc/PID/cmdline`` names the server, not the command. ``/proc/PID/environ`` (what the kernel keeps of the
  environment a process was started with, which a fork shares with its parent) lists the command's environment,
  as tests that find a job's processes by a marker variable need: each child writes it over a placeholder
  variable (:data:`ENVIRON_SLOT`) that comes first in the server's; the server's own variables follow it there.

The server is single-threaded and imports only; nothing it imports starts a thread, so forking it is safe.
Protocol (JSON lines over the server's stdin and stdout): ``{"id", "args", "env", "cwd", "out", "err"}`` starts a
command, answered ``{"started": id, "pid"}`` (or ``{"failed": id, "error"}``) at once; ``{"exited": id,
"status"}`` (the exit status, ``-N`` for signal N) follows whenever a child ends. The server watches its children
through pidfds (Linux 5.3 or later) in the same ``select`` as its stdin, so no child blocks another. When its stdin
closes (the test process ended, however it ended), it kills what is left of each child's session and exits; a
child dies with the server should the server die first.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

PRELOAD = ["torch", "mg_cli.main", "mg_cli.commands.train", "mg_cli.training.loop", "mg_models", "mg_data", "mg_ckpt"]
ENVIRON_SLOT = "MG_ZYGOTE_ENVIRON"
"""Placeholder variable, first in the server's environment, whose bytes each child overwrites with its own
environment (``/proc/PID/environ`` shows that memory)."""
ENVIRON_SLOT_BYTES = 65536
"""Room for a command's environment (under the kernel's 128 KiB limit on one variable)."""
_PR_SET_PDEATHSIG = 1


class ZygoteProcess:
    """A command forked by the server, handled as a ``subprocess.Popen`` is.

    Its output goes to files (``stdout_path``; ``stderr_path``, or None when stderr goes to stdout as with
    ``stderr=subprocess.STDOUT``), which :meth:`read_stdout` and :meth:`read_stderr` read as far as written."""

    def __init__(self, zygote: Zygote, request_id: int, pid: int, args: list[str], stdout: Path,
                 stderr: Path | None) -> None:
        self._zygote, self._id, self._server = zygote, request_id, zygote._proc
        self.pid, self.args, self.stdout_path, self.stderr_path = pid, args, stdout, stderr
        self.returncode: int | None = None
        """The exit status once known: ``-N`` when signal N ended the process."""

    def poll(self) -> int | None:
        """The exit status if the process has ended (and was reaped), else None."""
        if self.returncode is None:
            if self._zygote._proc is not self._server:
                raise RuntimeError("the mg test server that started this process has exited")
            self._zygote._pump(0)
            self.returncode = self._zygote._exited.pop(self._id, None)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Block until the process ends; its exit status. Raises ``subprocess.TimeoutExpired`` after ``timeout``
        seconds (the process goes on)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._zygote._pump(left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the process unless it has ended."""
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        """SIGTERM to the process."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to the process (not to what it started; see :meth:`kill_session`)."""
        self.send_signal(signal.SIGKILL)

    def kill_session(self) -> None:
        """SIGKILL to every process of the session the command leads (its process group)."""
        if self.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def read_stdout(self) -> str:
        """What the process has written to stdout so far (and to stderr, when that goes to stdout)."""
        return self.stdout_path.read_text(errors="replace")

    def read_stderr(self) -> str | None:
        """What the process has written to stderr so far; None when stderr goes to stdout."""
        return None if self.stderr_path is None else self.stderr_path.read_text(errors="replace")

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        """Wait for the process to end (``subprocess.TimeoutExpired`` after ``timeout`` seconds, the process going
        on); its ``(stdout, stderr)`` text, stderr None when it went to stdout."""
        self.wait(timeout)
        return self.read_stdout(), self.read_stderr()


class Zygote:
    """The client side: start the server on first use, then run commands through it."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._ids = itertools.count()
        self._buffer = b""
        self._started: dict[int, dict] = {}
        self._exited: dict[int, int] = {}

    def _server(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            env = {ENVIRON_SLOT: " " * ENVIRON_SLOT_BYTES, **os.environ, "PYTHONUNBUFFERED": "1"}
            self._proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          env=env)
            self._buffer, self._started, self._exited = b"", {}, {}
            self._pump(None)
            if self._started.pop(-1, None) is None:
                raise RuntimeError(f"the mg test server did not start: {self._buffer[:1000]!r}")
        return self._proc

    def _pump(self, timeout: float | None) -> None:
        """Take in what the server says within ``timeout`` seconds (None: until it says something)."""
        fd = self._proc.stdout.fileno()  # read raw: select() knows nothing of a file object's buffer
        while select.select([fd], [], [], None if timeout is None else max(0.0, timeout))[0]:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise RuntimeError("the mg test server exited")
            *lines, self._buffer = (self._buffer + chunk).split(b"\n")
            for line in lines:
                message = json.loads(line)
                if "exited" in message:
                    self._exited[message["exited"]] = message["status"]
                else:  # started, failed, or the server's ready (as id -1)
                    self._started[message.get("started", message.get("failed", -1))] = message
            timeout = 0  # then take in whatever else has arrived

    def popen(self, args: list[str], env: dict[str, str], cwd: Path | None, stdout: Path,
              stderr: Path | None = None) -> ZygoteProcess:
        """Start ``python -m mg_cli.main ARGS`` with exactly ``env`` in ``cwd`` (None: this process's), in a
        session of its own, its stdin ``/dev/null``, its stdout written to the file ``stdout`` and its stderr to
        ``stderr`` (None: to ``stdout``); both files are created (emptied) before this returns.

        Raises:
            OSError: the server could not fork.
        """
        server = self._server()
        for path in (stdout, stderr):
            if path is not None:
                open(path, "w").close()
        request_id = next(self._ids)
        request = {"id": request_id, "args": list(args), "env": dict(env), "cwd": os.path.abspath(cwd or os.getcwd()),
                   "out": os.path.abspath(stdout), "err": None if stderr is None else os.path.abspath(stderr)}
        server.stdin.write((json.dumps(request) + "\n").encode())
        server.stdin.flush()
        while request_id not in self._started:
            self._pump(None)
        reply = self._started.pop(request_id)
        if "failed" in reply:
            raise OSError(f"the mg test server could not start mg {' '.join(args)}: {reply['error']}")
        return ZygoteProcess(self, request_id, reply["pid"], [sys.executable, "-m", "mg_cli.main", *args],
                             Path(stdout), None if stderr is None else Path(stderr))

    def run(self, args: list[str], env: dict[str, str], cwd: Path | None, timeout: float, workdir: Path
            ) -> subprocess.CompletedProcess:
        """Run a command to its end (its output in ``workdir``), as ``subprocess.run(..., capture_output=True,
        text=True, timeout=timeout)`` does; on a timeout its whole session is killed first."""
        proc = self.popen(args, env, cwd, workdir / "stdout", workdir / "stderr")
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill_session()
            proc.wait()
            raise subprocess.TimeoutExpired(proc.args, timeout, proc.read_stdout(), proc.read_stderr()) from None
        except BaseException:  # an interrupted test: do not leave the command running
            proc.kill_session()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, proc.read_stdout(), proc.read_stderr())

    def close(self) -> None:
        """Stop the server (it kills the sessions of the commands still running)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait(timeout=30)


def _show_environment(env: dict[str, str]) -> None:
    """Write ``env`` over the placeholder variable's bytes, so that ``/proc/self/environ`` lists it."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start = int(fields[47])  # env_start, field 50 of proc(5); fields[0] is field 3
    head = f"{ENVIRON_SLOT}=".encode()
    if ctypes.string_at(start, len(head)) != head:
        raise RuntimeError(f"{ENVIRON_SLOT} is not the first variable of the mg test server's environment")
    size = len(ctypes.string_at(start)) + 1  # the placeholder and its NUL; nothing points there any more
    data = b"".join(os.fsencode(k) + b"=" + os.fsencode(v) + b"\0" for k, v in env.items())
    if len(data) > size:
        raise RuntimeError(f"the environment ({len(data)} bytes) exceeds the {size} the mg test server keeps")
    ctypes.memmove(start, data.ljust(size, b"\0"), size)


def _child(request: dict, server: int, inherited: list[int]) -> NoReturn:
    """In the forked child of process ``server``: become the command, then exit with its status (never returns)."""
    code = 1
    try:
        for fd in inherited:  # the server's pidfds of the other children
            os.close(fd)
        os.setsid()
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != server:  # the server died before that
            return
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        err = out if request["err"] is None else os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        for fd, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
        for fd in {null, out, err}:
            os.close(fd)
        try:
            os.chdir(request["cwd"])
            os.environ.clear()  # unsetenv: no C environ entry points into the placeholder after this
            os.environ.update(request["env"])
            _show_environment(os.environ)
            sys.path[0] = request["cwd"]  # as `python -m` has it
            import runpy

            sys.argv = ["mg_cli.main", *request["args"]]
            sys.modules.pop("mg_cli.main", None)  # `python -m` runs it as __main__ only (and runpy warns otherwise)
            runpy.run_module("mg_cli.main", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        import atexit

        atexit._run_exitfuncs()  # what the interpreter does at exit
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _send(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _start(request: dict, live: dict[int, tuple[int, int]]) -> None:
    """Fork the child for ``request`` and watch it (``live``: pidfd -> (request id, pid))."""
    server = os.getpid()
    try:
        pid = os.fork()
    except OSError as e:
        _send({"failed": request["id"], "error": str(e)})
        return
    if pid == 0:
        _child(request, server, list(live))
    live[os.pidfd_open(pid)] = (request["id"], pid)
    _send({"started": request["id"], "pid": pid})


def _stop(live: dict[int, tuple[int, int]]) -> None:
    """Kill the session of every child still running, and reap them."""
    for _, pid in live.values():
        for kill in (os.killpg, os.kill):  # the session it leads, and the child should it have left its group
            try:
                kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for _, pid in live.values():
        os.waitpid(pid, 0)


def serve() -> None:
    for name in PRELOAD:
        __import__(name)
    _send({"ready": True})
    stdin, pending = sys.stdin.fileno(), b""
    live: dict[int, tuple[int, int]] = {}
    while True:
        for fd in select.select([stdin, *live], [], [])[0]:
            if fd != stdin:  # a child ended
                request_id, pid = live.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                _send({"exited": request_id, "status": os.waitstatus_to_exitcode(status)})
                continue
            chunk = os.read(stdin, 1 << 16)
            if not chunk:
                _stop(live)
                return
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                _start(json.loads(line), live)


if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parents[2])
    serve()
