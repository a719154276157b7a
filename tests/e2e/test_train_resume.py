"""Resume: bit-exact at the same layout, within 1e-5 at another; SIGTERM saves and resumes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.conftest import mg, read_metrics, tiny_args, train_losses


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    """20 iterations in one go, and 10 iterations saved (the same run stopped early)."""
    root = tmp_path_factory.mktemp("resume")
    mg(*tiny_args(corpus, root / "straight"))
    # Stopped early: decay_iters pins the schedule to the 20-iteration run's.
    mg(*tiny_args(corpus, root / "first", f"checkpoint.save={root / 'ckpt'}", "optim.decay_iters=20", iters=10))
    return root, train_losses(root / "straight")


def test_same_layout_is_bit_exact(corpus, straight, tmp_path):
    root, ref = straight
    assert (root / "ckpt" / "iter_0000010" / "metadata.json").is_file()
    assert (root / "ckpt" / "latest").read_text().strip() == "10"
    ckpt = tmp_path / "ckpt"
    shutil.copytree(root / "ckpt", ckpt)  # --resume continues from the save directory's latest
    mg(*tiny_args(corpus, tmp_path / "log", f"checkpoint.save={ckpt}", "optim.decay_iters=20"), "--resume")
    resumed = train_losses(tmp_path / "log")
    assert sorted(resumed) == list(range(11, 21)), "a run resumed from iter_0000010 logs iterations 11.."
    for it in range(11, 21):
        assert resumed[it] == ref[it], f"iteration {it}: {resumed[it]!r} != {ref[it]!r}"


def test_async_saves_leave_training_unchanged_and_resume_exactly(corpus, straight, tmp_path):
    """Background-snapshot saves every 3 iterations: the run's own losses are untouched, and a
    checkpoint written while the next iteration ran resumes bit-exactly."""
    root, ref = straight
    ckpt = tmp_path / "ckpt"
    mg(*tiny_args(corpus, tmp_path / "async", f"checkpoint.save={ckpt}", "checkpoint.interval=3",
                  "checkpoint.async=true"))
    assert train_losses(tmp_path / "async") == ref
    assert (ckpt / "iter_0000006" / "metadata.json").is_file()
    mg(*tiny_args(corpus, tmp_path / "resumed", f"checkpoint.load={ckpt / 'iter_0000006'}"))
    resumed = train_losses(tmp_path / "resumed")
    assert sorted(resumed) == list(range(7, 21))
    for it in range(7, 21):
        assert resumed[it] == ref[it], f"iteration {it}: {resumed[it]!r} != {ref[it]!r}"


@pytest.mark.parametrize("nproc, sets", [(2, ["parallel.tp=2"]), (2, ["parallel.pp=2"]),
                                         (2, ["parallel.distributed_optimizer=true"])])
def test_changed_layout_within_tolerance(corpus, straight, tmp_path, nproc, sets):
    root, ref = straight
    mg(*tiny_args(corpus, tmp_path, f"checkpoint.load={root / 'ckpt' / 'iter_0000010'}", "optim.decay_iters=20", *sets),
       "--nproc-per-node", str(nproc))
    resumed = train_losses(tmp_path)
    assert sorted(resumed) == list(range(11, 21))
    for it in range(11, 21):
        assert resumed[it] == pytest.approx(ref[it], rel=1e-5), f"iteration {it}"


def test_sigterm_saves_and_resumes(corpus, tmp_path):
    log, ckpt = tmp_path / "log", tmp_path / "ckpt"
    args = tiny_args(corpus, log, f"checkpoint.save={ckpt}", iters=100000)
    proc = subprocess.Popen([sys.executable, "-m", "mg_cli.main", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if (log / "metrics.jsonl").exists() and len(read_metrics(log)) >= 3:
            break
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    stopped_at = max(train_losses(log))
    assert "stopping after iteration" in out
    assert (ckpt / "latest").read_text().strip() == str(stopped_at)
    mg(*tiny_args(corpus, tmp_path / "log2", f"checkpoint.save={ckpt}", iters=stopped_at + 2), "--resume")
    assert sorted(train_losses(tmp_path / "log2")) == [stopped_at + 1, stopped_at + 2]
