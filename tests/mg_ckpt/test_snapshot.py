"""Asynchronous saves with ``background_snapshot=True``: the copy runs behind the caller until ``wait_for_snapshot``."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist

import mg_ckpt._snapshot as snapshot_mod
import mg_ckpt.save as save_mod
from mg_ckpt import CheckpointError, latest_iteration, list_checkpoints, load_checkpoint, save_checkpoint
from mg_ckpt.save import wait_for_snapshot
from mg_parallel.testing import run_distributed
from tests.mg_ckpt.layouts import check_state, make_state


def _state(iteration: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(iteration)
    return {
        "w": torch.randn(64, 300, generator=g),
        "b": torch.randn(7, generator=g).bfloat16(),
        "step": torch.tensor(iteration, dtype=torch.int64),
        "t": torch.randn(40, 30, generator=g).t(),  # non-contiguous: copied whole
    }


def _load(path: str) -> dict[str, torch.Tensor]:
    out = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in _state(0).items()}
    load_checkpoint(path, out)
    return out


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(snapshot_mod, "_COPY_CHUNK", 1000)  # many chunks, so waiter and thread interleave


def _hold_at(step_name: str) -> tuple[threading.Event, threading.Event]:
    """Block the save thread at ``step_name`` until ``release`` is set; ``reached`` tells it got there."""
    reached, release = threading.Event(), threading.Event()

    def hook(step: str) -> None:
        if step == step_name:
            reached.set()
            release.wait(30)

    save_mod._fault_hook = hook
    return reached, release


def test_the_waiting_caller_makes_the_copy_when_the_thread_has_not(tmp_path, small_chunks):
    state = _state(1)
    want = {k: v.clone() for k, v in state.items()}
    reached, release = _hold_at("before_snapshot")  # the save thread copies nothing until released
    try:
        handle = save_checkpoint(str(tmp_path), 1, state, async_save=True, background_snapshot=True)
        assert reached.wait(30) and not handle.snapshot_done()
        wait_for_snapshot()  # the caller copies every chunk itself
        assert handle.snapshot_done() and not handle.done()
        for t in state.values():  # the optimizer step, right after the wait
            t.add_(100)
        release.set()
        handle.wait()
    finally:
        save_mod._fault_hook = None
        release.set()
    out = _load(str(tmp_path))
    assert all(torch.equal(out[k], want[k]) for k in want)


def test_mutation_right_after_the_wait_never_reaches_the_checkpoint(tmp_path, small_chunks):
    state = _state(2)
    for it in (1, 2, 3):  # the staging buffers are reused from the second save on
        want = {k: v.clone() for k, v in state.items()}
        handle = save_checkpoint(str(tmp_path), it, state, async_save=True, background_snapshot=True, keep_last=1)
        handle.wait_snapshot()
        for t in state.values():
            t.mul_(3)
        handle.wait()
        out = _load(str(tmp_path))
        assert latest_iteration(str(tmp_path)) == it
        assert all(torch.equal(out[k], want[k]) for k in want), it
    assert list_checkpoints(str(tmp_path)) == [3]


def test_callers_that_never_wait_still_get_the_snapshot_before_the_next_save(tmp_path):
    state = _state(3)
    want = {k: v.clone() for k, v in state.items()}
    first = save_checkpoint(str(tmp_path), 1, state, async_save=True, background_snapshot=True)
    second = save_checkpoint(str(tmp_path), 2, state)  # waits for the first save (copy included)
    assert first.done() and first.snapshot_done() and second.snapshot_done()
    out = _load(str(tmp_path))
    assert all(torch.equal(out[k], want[k]) for k in want)
    default = save_checkpoint(str(tmp_path), 3, state, async_save=True)
    assert default.snapshot_done()  # the default mode copies before returning
    save_mod.finalize()
    wait_for_snapshot()  # nothing pending: returns at once


def test_a_failed_background_copy_fails_the_save(tmp_path, monkeypatch):
    save_checkpoint(str(tmp_path), 1, _state(1))

    def broken(*args, **kwargs):
        raise MemoryError("copy failed (injected)")

    monkeypatch.setattr(np, "copyto", broken)
    handle = save_checkpoint(str(tmp_path), 2, _state(2), async_save=True, background_snapshot=True)
    wait_for_snapshot()  # does not raise: the failure belongs to the save
    assert handle.snapshot_done()
    with pytest.raises(CheckpointError, match="copy failed"):
        handle.wait()
    monkeypatch.undo()
    assert latest_iteration(str(tmp_path)) == 1


def test_background_snapshot_needs_async_save_and_a_supported_device(tmp_path):
    with pytest.raises(ValueError, match="background_snapshot"):
        save_checkpoint(str(tmp_path), 1, _state(1), background_snapshot=True)
    # Refused while the ranks still agree (with the gathered descriptions), so no rank hangs.
    with pytest.raises(CheckpointError, match="background_snapshot supports CPU and CUDA tensors, not \\['meta'\\]"):
        save_checkpoint(str(tmp_path), 1, {"w": torch.zeros(3, device="meta")}, async_save=True, background_snapshot=True)
    assert latest_iteration(str(tmp_path)) is None


def background_snapshot_on_ranks(save_dir: str) -> list[str]:
    """tp2 x dp2: save in the background, train (collectives), wait, update in place, save again, reload."""
    rank = dist.get_rank()
    state = make_state(rank, 2, 2, 1, True)
    locals_ = [v.local if hasattr(v, "local") else v for v in state.values()]
    save_checkpoint(save_dir, 1, state, async_save=True, background_snapshot=True)
    for _ in range(5):  # forward/backward: collectives and reads of the state
        x = torch.ones(1000)
        dist.all_reduce(x)
        assert x[0].item() == 4.0 and all(torch.isfinite(t).all() for t in locals_)
    wait_for_snapshot()
    for t in locals_:
        t.mul_(2.0)
    save_checkpoint(save_dir, 2, state, async_save=True, background_snapshot=True, keep_last=2)
    wait_for_snapshot()
    for t in locals_:
        t.mul_(5.0)  # after the wait: not in iteration 2
    save_mod.finalize()
    bad = []
    for it, factor in ((1, 1.0), (2, 2.0)):
        template = make_state(rank, 2, 2, 1, True, empty=True)
        load_checkpoint(f"{save_dir}/iter_{it:07d}", template)
        for v in template.values():
            (v.local if hasattr(v, "local") else v).div_(factor)
        bad += check_state(template, rank, 2, 2, 1, True)
    return bad


def test_background_snapshot_on_four_ranks(tmp_path):
    assert run_distributed(background_snapshot_on_ranks, 4, str(tmp_path)) == [[]] * 4
    assert list_checkpoints(str(tmp_path)) == [1, 2]
