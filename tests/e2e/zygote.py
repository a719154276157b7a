"""Run ``python -m mg_cli.main ARGS`` without paying the interpreter's start-up each time.

A server process imports torch and mg once, then forks one child per command. Each child is a process of its own
(own pid and session, own environment, working directory, stdout and stderr, exit status), exactly what
``subprocess.run([sys.executable, "-m", "mg_cli.main", ...])`` gives, minus the ~2 s of imports. What differs: a
module imported by the server read its environment variables then, so a command whose environment must change
how torch or mg import (none of the suite's do) is run as a plain subprocess (``mg(..., fresh=True)``).

The server is single-threaded and imports only; nothing it imports starts a thread, so forking it is safe.
Protocol (one JSON line each way over the server's stdin/stdout): ``{"args", "env", "cwd", "out", "err"}`` ->
``{"pid"}`` once forked, then ``{"status"}`` (the child's exit status, ``-N`` for signal N) once it ended.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

PRELOAD = ["torch", "mg_cli.main", "mg_cli.commands.train", "mg_cli.training.loop", "mg_models", "mg_data", "mg_ckpt"]


class Zygote:
    """The client side: start the server on first use, then run commands through it."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None

    def _server(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            self._proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          env=env, text=True, bufsize=1)
            ready = self._proc.stdout.readline()
            if json.loads(ready or "{}").get("ready") is not True:
                raise RuntimeError(f"the mg test server did not start: {ready!r}")
        return self._proc

    def run(self, args: list[str], env: dict, cwd: Path | None, timeout: float, workdir: Path
            ) -> subprocess.CompletedProcess:
        server = self._server()
        out, err = workdir / "stdout", workdir / "stderr"
        request = {"args": args, "env": env, "cwd": str(cwd or os.getcwd()), "out": str(out), "err": str(err)}
        server.stdin.write(json.dumps(request) + "\n")
        pid = json.loads(server.stdout.readline())["pid"]
        deadline = time.monotonic() + timeout
        status = None
        while status is None:
            ready, _, _ = select.select([server.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if ready:
                status = json.loads(server.stdout.readline())["status"]
            else:  # as subprocess.run does on a timeout: kill (the whole session the child leads), then raise
                try:
                    os.killpg(pid, 9)
                except ProcessLookupError:
                    pass
                json.loads(server.stdout.readline())
                raise subprocess.TimeoutExpired([sys.executable, "-m", "mg_cli.main", *args], timeout,
                                                out.read_text(errors="replace"), err.read_text(errors="replace"))
        return subprocess.CompletedProcess([sys.executable, "-m", "mg_cli.main", *args], status,
                                           out.read_text(errors="replace"), err.read_text(errors="replace"))

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait(timeout=30)


def _child(request: dict) -> None:
    """In the forked child: become the command, then exit with its status (never returns)."""
    code = 1
    try:
        os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        with open(os.devnull) as null, open(request["out"], "w") as out, open(request["err"], "w") as err:
            os.dup2(null.fileno(), 0)
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
        sys.path[0] = request["cwd"]  # as `python -m` has it
        import runpy

        sys.argv = ["mg_cli.main", *request["args"]]
        try:
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


def serve() -> None:
    for name in PRELOAD:
        __import__(name)
    reply = sys.stdout
    reply.write(json.dumps({"ready": True}) + "\n")
    reply.flush()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        _, status = os.waitpid(pid, 0)
        reply.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")
        reply.flush()


if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parents[2])
    serve()
