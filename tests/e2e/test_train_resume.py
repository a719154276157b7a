"""Resume: bit-exact at the same layout, within 1e-5 at another; SIGTERM saves and resumes."""

from __future__ import annotations

import shutil
import signal
import time

import pytest

from tests.e2e.conftest import mg, mg_start, read_metrics, tiny_args, train_losses


@pytest.fixture(scope="module")
def straight(layout_runs):
    """The shared single-process 20-iteration run, saved at iterations 10 and 20."""
    log, ckpt, _ = layout_runs.get(1)
    return ckpt, train_losses(log)


def test_same_layout_is_bit_exact(corpus, straight, tmp_path):
    saved, ref = straight
    assert (saved / "iter_0000010" / "metadata.json").is_file()
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved / "iter_0000010", ckpt / "iter_0000010")  # --resume continues from the latest
    (ckpt / "latest").write_text("10")
    mg(*tiny_args(corpus, tmp_path / "log", f"checkpoint.save={ckpt}"), "--resume")
    resumed = train_losses(tmp_path / "log")
    assert sorted(resumed) == list(range(11, 21)), "a run resumed from iter_0000010 logs iterations 11.."
    for it in range(11, 21):
        assert resumed[it] == ref[it], f"iteration {it}: {resumed[it]!r} != {ref[it]!r}"


def test_async_saves_leave_training_unchanged_and_resume_exactly(corpus, straight, tmp_path):
    """Background-snapshot saves every 3 iterations: the run's own losses are untouched, and a
    checkpoint written while the next iteration ran resumes bit-exactly."""
    _, ref = straight
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
    saved, ref = straight
    mg(*tiny_args(corpus, tmp_path, f"checkpoint.load={saved / 'iter_0000010'}", *sets),
       "--nproc-per-node", str(nproc))
    resumed = train_losses(tmp_path)
    assert sorted(resumed) == list(range(11, 21))
    for it in range(11, 21):
        assert resumed[it] == pytest.approx(ref[it], rel=1e-5), f"iteration {it}"


def test_sigterm_saves_and_resumes(corpus, tmp_path):
    log, ckpt = tmp_path / "log", tmp_path / "ckpt"
    args = tiny_args(corpus, log, f"checkpoint.save={ckpt}", iters=100000)
    proc = mg_start(*args, stdout=tmp_path / "out.txt")
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
