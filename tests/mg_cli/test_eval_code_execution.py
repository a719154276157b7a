"""Code execution: generated programs run in their own process group, which is killed whole when the program
exits or times out (a forked grandchild does not outlive it), under a memory limit set without ``preexec_fn``;
and ``eval.tasks`` with a humaneval task is refused at start unless ``eval.allow_code_execution`` is set."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mg_cli.evaluation.execution import MEMORY_LIMIT_BYTES, run_program

FORKS = """\
import os, time
pid = os.fork()
if pid == 0:
    time.sleep(60)
    os._exit(0)
with open({pidfile!r}, "w") as f:
    f.write(str(pid))
{then}
"""


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting for its new parent to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _gone_soon(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not _alive(pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("then, passes", [("time.sleep(60)", False), ("pass", True)], ids=["timeout", "exits"])
def test_a_forked_grandchild_does_not_outlive_the_program(tmp_path, then, passes):
    pidfile = tmp_path / "grandchild.pid"
    start = time.monotonic()
    assert run_program(FORKS.format(pidfile=str(pidfile), then=then), timeout_s=2.0) is passes
    assert time.monotonic() - start < 10
    grandchild = int(pidfile.read_text())
    assert _gone_soon(grandchild), f"grandchild {grandchild} is still running"


def test_pass_fail_timeout_and_memory_limit():
    assert run_program("assert __name__ == '__main__'\n", 10.0)
    assert not run_program("assert 1 + 1 == 3\n", 10.0)
    assert not run_program("import sys\nsys.exit(2)\n", 10.0)
    start = time.monotonic()
    assert not run_program("while True:\n    pass\n", 0.5)
    assert time.monotonic() - start < 5
    if sys.platform.startswith("linux"):
        assert run_program(f"import resource, sys\nsys.exit(resource.getrlimit(resource.RLIMIT_AS)[0] != "
                           f"{MEMORY_LIMIT_BYTES})\n", 10.0)


def test_no_preexec_fn(monkeypatch):
    """``preexec_fn`` is unsafe in a process with threads (the evaluation process has them)."""
    seen = []
    real = subprocess.Popen

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", spy)
    assert run_program("pass\n", 10.0)
    assert seen and all(kw.get("preexec_fn") is None and kw.get("start_new_session") for kw in seen)


def _humaneval_file(tmp_path):
    f = tmp_path / "he.jsonl"
    f.write_text(json.dumps({"prompt": "def f():\n", "test": "def check(g):\n    g()\n", "entry_point": "f"}) + "\n")
    return f


def test_train_refuses_a_code_task_at_start_unless_allowed(tmp_path):
    from mg_cli.config import ConfigError, load_config
    from mg_cli.training.tasks import parse_tasks

    f = _humaneval_file(tmp_path)
    with pytest.raises(ConfigError, match=r"eval.tasks: he=humaneval:.*he.jsonl.*eval.allow_code_execution: true"):
        load_config(None, [f"eval.tasks=[he=humaneval:{f}, choice:{f}]"])
    config = load_config(None, [f"eval.tasks=[he=humaneval:{f}]", "eval.allow_code_execution=true"])
    assert [s.kind for s in parse_tasks(config)] == ["humaneval"]
    load_config(None, [f"eval.tasks=[choice:{f}]"])  # no code task, nothing to allow


def test_train_stops_in_one_line_before_any_worker(tmp_path):
    from click.testing import CliRunner

    from mg_cli.main import cli

    f = _humaneval_file(tmp_path)
    result = CliRunner().invoke(cli, ["train", "--set", f"eval.tasks=[humaneval:{f}]", "--nproc-per-node", "2"])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("Error: ") \
        and "eval.tasks: humaneval:" in lines[0] and "eval.allow_code_execution" in lines[0], \
        result.output
