"""Data-loader worker processes do not change what a run trains on.

The default ``data.num_workers`` (a worker process reading samples) and ``data.num_workers=2`` run the first
iterations of the shared one-process tiny run, which loads in the training process (``data.num_workers=0``),
and give the same loss at every iteration, bit for bit. The runs are shortened with the reference's LR decay
length, so every iteration has the reference's learning rate. While each runs, its processes are counted: the
trainer and its loader workers."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from tests.e2e.conftest import mg_start, processes_with_marker, tiny_args, train_losses

ITERS = 4


def _without_workers_setting(args: list[str]) -> list[str]:
    """``args`` without the ``--set data.num_workers=...`` of the test defaults, so the run uses the default."""
    i = args.index("data.num_workers=0")
    assert args[i - 1] == "--set"
    return args[:i - 1] + args[i + 1:]


def _run_counting_processes(args: list[str], output: Path) -> tuple[str, int]:
    """Run ``mg ARGS`` (its output to the file ``output``); return its output and the most processes of the run
    seen at once."""
    marker = f"workers-{uuid.uuid4().hex}"
    proc = mg_start(*args, stdout=output, env={"MG_RUN_ID": marker})
    most = 0
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        most = max(most, len(processes_with_marker(marker)))
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    out = proc.communicate()[0]
    assert proc.returncode == 0, f"mg train exited {proc.returncode}\n{out[-5000:]}"
    return out, most


@pytest.mark.parametrize("workers", [None, 2], ids=["default", "2"])
def test_loader_workers_keep_the_losses_of_loading_in_process(workers, corpus, layout_runs, tmp_path):
    from mg_cli.sections import DataKeys

    ref_log, _, _ = layout_runs.get(1)
    ref = train_losses(ref_log)
    args = tiny_args(corpus, tmp_path / "log", f"optim.decay_iters={max(ref)}", iters=ITERS)
    if workers is None:
        args = _without_workers_setting(args)
        workers = DataKeys.num_workers
        assert workers > 0, "the default loads in the training process; this test is about worker processes"
    else:
        args += ["--set", f"data.num_workers={workers}"]
    out, most = _run_counting_processes(args, tmp_path / "out.txt")
    assert most >= 1 + workers, f"expected the trainer and {workers} loader workers, saw {most} processes"
    losses = train_losses(tmp_path / "log")
    assert sorted(losses) == list(range(1, ITERS + 1)), out[-3000:]
    for it, loss in losses.items():
        assert loss == ref[it], f"iteration {it}: loss {loss!r} with {workers} workers, {ref[it]!r} without"
