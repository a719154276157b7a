"""CheckpointSaver: the object that owns pending saves, staging buffers and the coordination group."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import threading

import pytest
import torch
import torch.distributed as dist

import mg_ckpt.save as save_mod
from mg_ckpt import CheckpointError, CheckpointSaver, latest_iteration, list_checkpoints, load_checkpoint
from mg_parallel.testing import run_distributed
from tests.mg_ckpt.layouts import check_state, make_state


def state_at(iteration: int) -> dict[str, torch.Tensor]:
    """A state whose values identify the iteration."""
    return {f"t{i}": torch.full((1000,), float(iteration * 10 + i)) for i in range(3)}


def loaded_iteration(path: str, saver: CheckpointSaver | None = None) -> int:
    out = {f"t{i}": torch.zeros(1000) for i in range(3)}
    it = load_checkpoint(path, out, saver=saver)["iteration"]
    assert all(torch.equal(out[f"t{i}"], torch.full((1000,), float(it * 10 + i))) for i in range(3))
    return it


@pytest.fixture
def fault_hook():
    """Install ``save_mod._fault_hook`` for one test, and always remove it."""
    yield lambda hook: setattr(save_mod, "_fault_hook", hook)
    save_mod._fault_hook = None


def test_close_waits_for_the_pending_save_and_frees_the_buffers(tmp_path, fault_hook):
    release = threading.Event()
    fault_hook(lambda step: release.wait(30) if step == "before_write" else None)
    saver = CheckpointSaver()
    handle = saver.save(str(tmp_path), 1, state_at(1), async_save=True)
    assert len(saver._staging) == 3 and not handle.done()
    threading.Timer(0.2, release.set).start()  # the write goes on only after close() started waiting
    saver.close()
    assert handle.done() and latest_iteration(str(tmp_path)) == 1
    assert saver.closed and len(saver._staging) == 0 and saver.group is None
    saver.close()  # a second close is a no-op
    with pytest.raises(CheckpointError, match="closed; create a new one"):
        saver.save(str(tmp_path), 2, state_at(2))
    with pytest.raises(CheckpointError, match="closed"):
        load_checkpoint(str(tmp_path), state_at(0), saver=saver)


def test_close_raises_the_failure_of_a_background_save(tmp_path, fault_hook):
    saver = CheckpointSaver()
    saver.save(str(tmp_path), 1, state_at(1))

    def boom(step: str) -> None:
        if step == "before_rename":
            raise OSError("disk full (injected)")

    fault_hook(boom)
    saver.save(str(tmp_path), 2, state_at(2), async_save=True)  # not waited for by the caller
    with pytest.raises(CheckpointError, match="disk full"):
        saver.close()
    assert saver.closed and len(saver._staging) == 0  # closed and freed although the save failed
    saver.close()  # the failure was reported once
    assert latest_iteration(str(tmp_path)) == 1 and loaded_iteration(str(tmp_path)) == 1


def test_with_block_closes_and_surfaces_failures(tmp_path, fault_hook):
    with CheckpointSaver() as saver:
        state = state_at(1)
        handle = saver.save(str(tmp_path), 1, state, async_save=True, background_snapshot=True)
        saver.wait_for_snapshot()
        for t in state.values():  # the optimizer step, after the wait: not in the checkpoint
            t.add_(1000.0)
    assert saver.closed and handle.done() and loaded_iteration(str(tmp_path)) == 1

    fault_hook(lambda step: (_ for _ in ()).throw(OSError("injected")) if step == "after_shard" else None)
    with pytest.raises(CheckpointError, match="injected"):  # raised by the exit of the block
        with CheckpointSaver() as saver:
            saver.save(str(tmp_path), 2, state_at(2), async_save=True)
    assert saver.closed

    # The block's own exception wins; the save failure becomes a warning instead of replacing it.
    with pytest.warns(RuntimeWarning, match="pending save failed while the with block raised KeyError.*injected"):
        with pytest.raises(KeyError, match="the loop's own error"):
            with CheckpointSaver() as saver:
                saver.save(str(tmp_path), 3, state_at(3), async_save=True)
                raise KeyError("the loop's own error")
    assert saver.closed and latest_iteration(str(tmp_path)) == 1


def test_two_savers_do_not_share_state(tmp_path, fault_hook):
    a_dir, b_dir = str(tmp_path / "a"), str(tmp_path / "b")
    a, b = CheckpointSaver(), CheckpointSaver()
    try:
        # Pending saves: a's background copy is held; b's wait_for_snapshot and saves ignore it.
        reached, release = threading.Event(), threading.Event()

        def hold(step: str) -> None:
            if step == "before_snapshot" and threading.current_thread().name == "mg-ckpt-save-1":
                reached.set()
                release.wait(30)

        fault_hook(hold)
        first = a.save(a_dir, 1, state_at(1), async_save=True, background_snapshot=True)
        assert reached.wait(30)
        b.wait_for_snapshot()
        b.save(b_dir, 2, {"only_b": torch.ones(5)}, async_save=True)
        b.wait()
        assert not first.snapshot_done() and not first.done()
        a.wait_for_snapshot()  # a's own wait makes its copy (the caller helps on CPU)
        assert first.snapshot_done()
        release.set()

        # Staging buffers: each saver has its own, keyed by its own state; freeing one keeps the other.
        assert len(a._staging) == 3 and len(b._staging) == 1
        a.release_staging_buffers()
        assert len(a._staging) == 0 and len(b._staging) == 1
        assert first.done() and latest_iteration(a_dir) == 1 and latest_iteration(b_dir) == 2

        # A failure belongs to the saver whose save failed.
        fault_hook(lambda step: (_ for _ in ()).throw(OSError("a failed (injected)")) if step == "before_rename" else None)
        a.save(a_dir, 3, state_at(3), async_save=True)
        a._pending[0]._thread.join()
        fault_hook(None)
        b.save(b_dir, 4, {"only_b": torch.ones(5)})  # b neither raises nor waits for a's failure
        assert loaded_iteration(a_dir, saver=b) == 1  # nor does a load through b
        with pytest.raises(CheckpointError, match="a failed"):
            a.wait()
        # The convenience path's default saver is a third, separate one.
        assert save_mod._PROCESS.default is not a and save_mod._PROCESS.default is not b
    finally:
        release.set()
        a.close()
        b.close()


def test_group_must_be_valid_and_the_saver_belongs_to_one_job(tmp_path):
    with pytest.raises(ValueError, match="torch.distributed is not initialised; pass group=None"):
        CheckpointSaver(group=object())
    saver = CheckpointSaver()  # single process: no group
    assert saver.group is None
    init = tempfile.mktemp(prefix="mg-ckpt-store-")
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    try:
        with pytest.raises(CheckpointError, match="create the saver after init_process_group"):
            saver.save(str(tmp_path), 1, state_at(1))
        with CheckpointSaver() as inside:
            assert inside.group is not None and inside.group is not dist.group.WORLD
            inside.save(str(tmp_path), 1, state_at(1), async_save=True)
        left_open = CheckpointSaver()
    finally:
        dist.destroy_process_group()
        if os.path.exists(init):
            os.remove(init)
    with pytest.raises(CheckpointError, match="destroyed or re-initialised"):
        left_open.save(str(tmp_path), 2, state_at(2))
    left_open.close()
    assert loaded_iteration(str(tmp_path), saver=saver) == 1  # single process again: the first saver is valid
    saver.close()


def saves_without_creating_groups(save_dir: str) -> list[str]:
    """Two ranks (tp2): savers built once, then saves and loads with group creation forbidden."""
    rank = dist.get_rank()
    own = CheckpointSaver()  # collective: creates its gloo group here
    given = CheckpointSaver(group=dist.new_group(backend="gloo"))
    lone = dist.new_group(ranks=[0])  # collective too; holds rank 0 only
    bad: list[str] = []
    try:
        CheckpointSaver(group=lone)
        bad.append("a group without every rank was accepted")
    except ValueError as e:
        if "must hold every rank" not in str(e):
            bad.append(str(e))
    real_new_group = dist.new_group

    def forbidden(*args, **kwargs):
        raise AssertionError("a process group was created during a save or load")

    dist.new_group = forbidden
    try:
        for saver, sub in ((own, "own"), (given, "given")):
            state = make_state(rank, 2, 1, 1, False)
            locals_ = [v.local if hasattr(v, "local") else v for v in state.values()]
            saver.save(f"{save_dir}/{sub}", 1, state)
            saver.save(f"{save_dir}/{sub}", 2, state, async_save=True, background_snapshot=True)
            x = torch.ones(10)
            dist.all_reduce(x)  # training collectives on WORLD while the save thread commits
            saver.wait_for_snapshot()
            for t in locals_:
                t.mul_(3.0)  # after the wait: not in iteration 2
            template = make_state(rank, 2, 1, 1, False, empty=True)
            load_checkpoint(f"{save_dir}/{sub}", template, saver=saver)  # waits for iteration 2
            bad += [f"{sub}: {n}" for n in check_state(template, rank, 2, 1, 1, False)]
            saver.close()
    finally:
        dist.new_group = real_new_group
        own.close()
        given.close()
    return bad


def test_no_process_group_is_created_during_a_save(tmp_path):
    assert run_distributed(saves_without_creating_groups, 2, str(tmp_path)) == [[], []]
    assert list_checkpoints(str(tmp_path / "own")) == [1, 2] and list_checkpoints(str(tmp_path / "given")) == [1, 2]


EXIT_SCRIPT = """
import sys, torch
from mg_ckpt import CheckpointSaver, save_checkpoint

root = sys.argv[1]
state = {"w": torch.arange(1000.0)}
a = CheckpointSaver()
a.save(root + "/a", 1, state, async_save=True)
b = CheckpointSaver()
b.save(root + "/b", 1, state, async_save=True)
with CheckpointSaver() as closed:
    closed.save(root + "/c", 1, state, async_save=True)
save_checkpoint(root + "/d", 1, state, async_save=True)
"""


def test_exit_without_close_flushes_and_warns_once(tmp_path):
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(EXIT_SCRIPT), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "mg-ckpt" in line]
    assert lines == [
        "mg-ckpt: 3 checkpoint saves still pending at exit: CheckpointSaver.close() (on 2 savers) and "
        "mg_ckpt.finalize() were not called; waiting for them now"
    ], proc.stderr
    assert all(latest_iteration(str(tmp_path / d)) == 1 for d in "abcd")
