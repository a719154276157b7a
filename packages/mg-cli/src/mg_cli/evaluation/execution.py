"""Running generated programs: a subprocess per program, a fresh temporary directory, a time limit.

This is containment against accidents (a loop that never ends, a stray file write), not a security
sandbox: generated code runs with the user's permissions, which is why ``mg eval`` runs it only
with ``--allow-code-execution``. Programs get an isolated interpreter (``python -I``: no user site,
no ``PYTHON*`` variables, the script's directory not on the path), an environment without proxy
settings, no standard input, and, on Linux, a 4 GiB address-space limit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

__all__ = ["CodeExecutionRefused", "run_program"]

MEMORY_LIMIT_BYTES = 4 << 30


class CodeExecutionRefused(ValueError):
    """A code task was asked for without ``--allow-code-execution``."""

    def __init__(self, path: str) -> None:
        super().__init__(f"{path}: humaneval runs the programs the model writes, which are untrusted code; "
                         f"pass --allow-code-execution to run them (in subprocesses with a time limit)")


def _limit_memory() -> None:  # runs in the child before exec
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    except (ImportError, ValueError, OSError):
        pass


def run_program(source: str, timeout_s: float) -> bool:
    """True when ``source`` runs to exit status 0 within ``timeout_s`` seconds in a fresh directory."""
    env = {"PATH": os.environ.get("PATH", ""), "HOME": "", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
    with tempfile.TemporaryDirectory(prefix="mg-eval-") as tmp:
        path = os.path.join(tmp, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(source)
        env["HOME"] = env["TMPDIR"] = tmp
        try:
            proc = subprocess.run([sys.executable, "-I", path], cwd=tmp, env=env, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout_s,
                                  preexec_fn=_limit_memory if sys.platform.startswith("linux") else None,
                                  start_new_session=True)
        except subprocess.TimeoutExpired:
            return False
        return proc.returncode == 0
