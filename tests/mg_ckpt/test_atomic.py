"""Atomic commit under crashes, asynchronous saves, and retention."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import mg_ckpt.save as save_mod
from mg_ckpt import (
    CheckpointError,
    latest_iteration,
    list_checkpoints,
    load_checkpoint,
    release_staging_buffers,
    save_checkpoint,
)
from mg_parallel.testing import run_distributed
from tests.mg_ckpt.layouts import check_state, make_state


def state_at(iteration: int, numel: int = 4096) -> dict[str, torch.Tensor]:
    """A state whose values identify the iteration (so a load shows which checkpoint it read)."""
    return {f"t{i}": torch.full((numel,), float(iteration * 10 + i)) for i in range(4)}


def crash_child(save_dir: str, point: str, numel: int) -> None:
    """Save iteration 1, then die (os._exit) at ``point`` while saving iteration 2."""
    save_checkpoint(save_dir, 1, state_at(1, numel))

    def hook(step: str) -> None:
        if step == point:
            os._exit(17)

    save_mod._fault_hook = hook
    save_checkpoint(save_dir, 2, state_at(2, numel))
    os._exit(0)


def loop_child(save_dir: str, numel: int, announce: int) -> None:
    """Save iterations 1, 2, ... forever, writing each committed iteration to fd ``announce``."""
    for it in range(1, 10_000):
        save_checkpoint(save_dir, it, state_at(it, numel), keep_last=2)
        os.write(announce, b"%d\n" % it)


def _fork(fn, *args) -> int:
    """Run ``fn(*args)`` in a forked child (no interpreter start-up) and return its pid.

    The child never returns into pytest: it ends with ``os._exit``. Tensors stay small so that
    no intra-op thread pool is used after the fork.
    """
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn(*args)
            code = 0
        finally:
            os._exit(code)
    return pid


def _exit_code(pid: int, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError("child did not finish")


def _loaded_iteration(save_dir: str, numel: int = 4096) -> int:
    out = {f"t{i}": torch.zeros(numel) for i in range(4)}
    extra = load_checkpoint(save_dir, out)
    it = extra["iteration"]
    for i in range(4):
        assert torch.equal(out[f"t{i}"], torch.full((numel,), float(it * 10 + i)))
    return it


@pytest.mark.parametrize(
    "point, expect", [("after_shard", 1), ("before_rename", 1), ("after_rename", 1), ("after_latest", 2)]
)
def test_crash_at_each_commit_step_leaves_a_loadable_checkpoint(tmp_path, point, expect):
    assert _exit_code(_fork(crash_child, str(tmp_path), point, 4096)) == 17
    assert latest_iteration(str(tmp_path)) == expect
    assert _loaded_iteration(str(tmp_path)) == expect
    if point in ("after_shard", "before_rename"):
        assert any(n.startswith(".tmp_iter_") for n in os.listdir(tmp_path))
        assert list_checkpoints(str(tmp_path)) == [1]
    # The next save cleans up whatever the crash left behind.
    save_checkpoint(str(tmp_path), 3, state_at(3))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]
    assert _loaded_iteration(str(tmp_path)) == 3


def test_kill_at_random_moments(tmp_path):
    rng = random.Random(1234)
    numel = 1 << 14
    read_fd, write_fd = os.pipe()
    pid = _fork(loop_child, str(tmp_path), numel, write_fd)
    os.close(write_fd)
    try:
        with os.fdopen(read_fd) as announced:
            assert announced.readline().strip() == "1"
            for _ in range(4):
                time.sleep(rng.uniform(0.01, 0.1))
                os.kill(pid, signal.SIGSTOP)  # freeze it mid-save, then check what is visible
                assert _loaded_iteration(str(tmp_path), numel) >= 1
                os.kill(pid, signal.SIGCONT)
            time.sleep(rng.uniform(0.01, 0.1))
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    assert _loaded_iteration(str(tmp_path), numel) == latest_iteration(str(tmp_path))
    # keep_last=2, plus one more if the kill landed between a commit and its retention pass.
    assert len(list_checkpoints(str(tmp_path))) <= 3
    save_checkpoint(str(tmp_path), 10_000, state_at(1, numel), keep_last=2)
    assert len(list_checkpoints(str(tmp_path))) == 2


def test_async_save_keeps_values_at_call_time(tmp_path):
    release = threading.Event()
    save_checkpoint(str(tmp_path), 1, state_at(1))
    save_mod._fault_hook = lambda step: release.wait(30) if step == "before_write" else None
    try:
        state = state_at(2)
        handle = save_checkpoint(str(tmp_path), 2, state, async_save=True)
        for t in state.values():  # training goes on and modifies the tensors in place
            t.add_(1000.0)
        assert not handle.done() and latest_iteration(str(tmp_path)) == 1
        release.set()
        handle.wait()
    finally:
        save_mod._fault_hook = None
        release.set()
    assert handle.done() and latest_iteration(str(tmp_path)) == 2
    assert _loaded_iteration(str(tmp_path)) == 2


def test_async_saves_reuse_buffers_but_not_values(tmp_path):
    nice = os.getpriority(os.PRIO_PROCESS, 0)  # the writer lowers its own thread's priority only
    state = state_at(0)
    for it in (1, 2, 3):
        for i, t in enumerate(state.values()):
            t.fill_(float(it * 10 + i))
        handle = save_checkpoint(str(tmp_path), it, state, async_save=True, keep_last=1)
        for t in state.values():
            t.fill_(-1.0)
        handle.wait()
        assert _loaded_iteration(str(tmp_path)) == it
    assert len(save_mod.default_saver()._staging) == 4 and os.getpriority(os.PRIO_PROCESS, 0) == nice
    release_staging_buffers()
    assert not save_mod.default_saver()._staging


def test_async_failure_is_reraised_not_swallowed(tmp_path):
    save_checkpoint(str(tmp_path), 1, state_at(1))

    def boom(step: str) -> None:
        if step == "before_rename":
            raise OSError("disk full (injected)")

    save_mod._fault_hook = boom
    try:
        handle = save_checkpoint(str(tmp_path), 2, state_at(2), async_save=True)
        for _ in range(2):  # every wait() reports it
            with pytest.raises(CheckpointError, match="disk full"):
                handle.wait()
        handle = save_checkpoint(str(tmp_path), 3, state_at(3), async_save=True)
        # Not waited for by the caller: the next save raises it instead.
        with pytest.raises(CheckpointError, match="disk full"):
            save_checkpoint(str(tmp_path), 4, state_at(4))
    finally:
        save_mod._fault_hook = None
    assert latest_iteration(str(tmp_path)) == 1 and _loaded_iteration(str(tmp_path)) == 1
    save_checkpoint(str(tmp_path), 5, state_at(5))
    assert _loaded_iteration(str(tmp_path)) == 5


def async_train_and_save(save_dir: str) -> list[str]:
    """Four ranks (tp2 x dp2): async save, keep 'training' (collectives + in-place updates), save again."""
    rank = dist.get_rank()
    state = make_state(rank, 2, 2, 1, True)
    locals_ = [v.local if hasattr(v, "local") else v for v in state.values()]
    first = save_checkpoint(save_dir, 1, state, async_save=True, layout={"tp": 2, "dp": 2})
    for _ in range(20):  # collectives on the training group while the background thread commits
        x = torch.ones(1000)
        dist.all_reduce(x)
        assert x[0].item() == 4.0
    for t in locals_:
        t.mul_(2.0)
    save_checkpoint(save_dir, 2, state, async_save=True, keep_last=1)
    first.wait()
    save_mod.finalize()
    # Reload this layout from iteration 2: values are twice the globals (exact in floating point).
    template = make_state(rank, 2, 2, 1, True, empty=True)
    load_checkpoint(save_dir, template)
    for v in template.values():
        (v.local if hasattr(v, "local") else v).div_(2.0)
    return check_state(template, rank, 2, 2, 1, True)


def test_async_save_on_four_ranks(tmp_path):
    bad = run_distributed(async_train_and_save, 4, str(tmp_path))
    assert bad == [[]] * 4
    assert list_checkpoints(str(tmp_path)) == [2]


def test_keep_last_retention(tmp_path):
    for it in range(1, 6):
        save_checkpoint(str(tmp_path), it, state_at(it), keep_last=2)
    assert list_checkpoints(str(tmp_path)) == [4, 5]

    save_mod._fault_hook = lambda step: (_ for _ in ()).throw(OSError("injected")) if step == "before_rename" else None
    try:
        with pytest.raises(CheckpointError, match="injected"):
            save_checkpoint(str(tmp_path), 6, state_at(6), keep_last=1)
    finally:
        save_mod._fault_hook = None
    # A failed save deletes nothing.
    assert list_checkpoints(str(tmp_path)) == [4, 5] and _loaded_iteration(str(tmp_path)) == 5
    save_checkpoint(str(tmp_path), 7, state_at(7), keep_last=1)
    assert list_checkpoints(str(tmp_path)) == [7] and _loaded_iteration(str(tmp_path)) == 7
