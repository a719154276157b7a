"""Saving: plan who writes which piece, write shards into a hidden directory, commit atomically.

Protocol (every rank, collectively when ``torch.distributed`` is initialised):

1. wait for the previous asynchronous save (re-raising its failure);
2. all-gather each rank's piece descriptions; every rank derives the same plan: for each
   distinct piece, the ranks holding it are its replicas and one of them (spread by a hash of
   the tensor name) writes it;
3. rank 0 removes stale ``.tmp_iter_*``/``.trash_*`` directories and creates ``.tmp_iter_N``;
4. each rank copies the pieces it writes to CPU memory (asynchronous saves only, or for device
   tensors) and writes ``rank_RRRRR.safetensors``, fsync'ed, hashing it as it goes;
5. the file sizes/checksums are all-gathered; rank 0 writes ``metadata.json`` (fsync), fsyncs the
   directory, renames it to ``iter_N``, fsyncs the save directory, then atomically replaces
   ``latest`` and applies retention; the outcome is broadcast so every rank raises on failure.

Steps 4-5 run in a background thread for ``async_save=True``; the commit then happens as soon as
every rank's writes are done, without waiting for the main thread (the coordination group is a
dedicated gloo group, see :mod:`mg_ckpt._dist`). With ``background_snapshot=True`` the copy of
step 4 also runs in that thread (a side stream for CUDA tensors) and the caller must call
:func:`wait_for_snapshot` before it next modifies the saved tensors (the optimizer step).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import threading
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from mg_ckpt import _dist
from mg_ckpt._io import DEFAULT_CHECKSUM, dtype_name, fsync_dir, write_safetensors
from mg_ckpt._snapshot import _STAGING, _snapshot, _SnapshotCopy, _staging
from mg_ckpt.errors import CheckpointError
from mg_ckpt.metadata import (
    FORMAT_NAME,
    FORMAT_VERSION,
    METADATA_FILE,
    checkpoint_dir,
    list_checkpoints,
    temp_dir,
    validate_metadata,
    write_latest,
)
from mg_ckpt.sharded import ShardedTensor

__all__ = ["SaveHandle", "finalize", "release_staging_buffers", "save_checkpoint", "wait_for_snapshot"]

CHECKSUM = DEFAULT_CHECKSUM
"""Checksum algorithm of the shard files written (recorded under its name in ``metadata.json``)."""

# Test hook for crash injection: called with the name of each commit step (see _step).
_fault_hook: Callable[[str], None] | None = None
_PENDING: list[SaveHandle] = []


def _step(name: str) -> None:
    if _fault_hook is not None:
        _fault_hook(name)


class SaveHandle:
    """A save in progress (asynchronous) or done (synchronous).

    ``wait()`` blocks until the checkpoint is committed and re-raises any failure of the
    background write or commit (on every call, so it cannot be lost).
    """

    def __init__(self, path: str, iteration: int) -> None:
        self.path = path
        """Final directory of the checkpoint (``save_dir/iter_N``)."""
        self.iteration = iteration
        """The iteration saved."""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._copy: _SnapshotCopy | None = None

    def done(self) -> bool:
        """True once the save finished (committed or failed)."""
        return self._thread is None or not self._thread.is_alive()

    def snapshot_done(self) -> bool:
        """True once the saved tensors are no longer read: the state may be modified in place.

        Always true when ``save_checkpoint`` returns, except with ``background_snapshot=True``.
        """
        return self._copy is None or self._copy.done.is_set()

    def wait_snapshot(self) -> None:
        """Block until :meth:`snapshot_done`; on CPU the caller helps with the remaining copies.

        A failed copy does not raise here: the save then fails and :meth:`wait` raises.
        """
        if self._copy is not None:
            self._copy.run()
            self._copy.done.wait()

    def wait(self) -> None:
        """Block until the checkpoint is committed.

        Raises:
            CheckpointError: the write or commit failed on this or another rank.
        """
        if self._thread is not None:
            self._thread.join()
        if self in _PENDING:  # the caller now sees the outcome; later saves need not report it again
            _PENDING.remove(self)
        if self._error is not None:
            if isinstance(self._error, CheckpointError):
                raise self._error
            raise CheckpointError(f"saving {self.path} failed: {self._error!r}") from self._error


def wait_for_snapshot() -> None:
    """Block until every pending asynchronous save has copied the state it saves (see ``background_snapshot``).

    Call it before modifying saved tensors in place after a ``save_checkpoint(...,
    background_snapshot=True)``, e.g. right before ``optimizer.step()``; forward and backward may
    run before it, as they only read parameters and optimizer state. On CPU the caller copies
    what the background thread has not yet copied, so it never waits longer than a blocking copy.
    Returns at once when no such copy is pending. Never raises: failures come from
    ``SaveHandle.wait``, :func:`finalize` or the next save.
    """
    for handle in list(_PENDING):
        handle.wait_snapshot()


def finalize() -> None:
    """Wait for every pending asynchronous save (call before exit or before reading checkpoints).

    Raises:
        CheckpointError: the first failed pending save (the others are still waited for).
    """
    first: BaseException | None = None
    while _PENDING:
        handle = _PENDING[0]
        try:
            handle.wait()
        except CheckpointError as e:
            first = first or e
    if first is not None:
        raise first


atexit.register(finalize)


def _describe(name: str, value: torch.Tensor | ShardedTensor) -> ShardedTensor:
    if isinstance(value, ShardedTensor):
        return value
    if isinstance(value, torch.Tensor):
        return ShardedTensor(value, tuple(value.shape))
    raise ValueError(f"save_checkpoint: state[{name!r}] must be a torch.Tensor or ShardedTensor, got {type(value).__name__}")


def _plan(descs: list[list[tuple]], ckpt: str) -> tuple[dict[str, Any], dict[int, list[str]]]:
    """From every rank's descriptors: the metadata ``tensors`` table and, per rank, the names it writes."""
    tensors: dict[str, Any] = {}
    holders: dict[tuple, list[int]] = {}
    declared: dict[tuple, int] = {}
    for r, rank_descs in enumerate(descs):
        for name, gshape, dtype, off, lshape, fr, nrep in rank_descs:
            t = tensors.setdefault(name, {"shape": list(gshape), "dtype": dtype, "pieces": []})
            if t["shape"] != list(gshape) or t["dtype"] != dtype:
                raise CheckpointError(
                    f"saving {ckpt}: tensor {name!r} is {t['dtype']}{t['shape']} on one rank but "
                    f"{dtype}{list(gshape)} on rank {r}; every rank must describe the same global tensor"
                )
            piece = (name, tuple(off), tuple(lshape), fr)
            holders.setdefault(piece, []).append(r)
            declared[piece] = max(declared.get(piece, 1), nrep)
    writes: dict[int, list[str]] = {}
    for piece, ranks in holders.items():
        name, off, lshape, fr = piece
        if declared[piece] > 1 and len(ranks) != declared[piece]:
            raise CheckpointError(
                f"saving {ckpt}: piece of {name!r} at offset {list(off)} is held by ranks {ranks} but declared "
                f"num_replicas={declared[piece]}; fix the ShardedTensor replica description"
            )
        writer = ranks[zlib.crc32(f"{name}|{off}|{fr}".encode()) % len(ranks)]
        writes.setdefault(writer, []).append(name)
        tensors[name]["pieces"].append(
            {
                "file": _shard_name(writer),
                "key": name,
                "offset": list(off),
                "shape": list(lshape),
                "flat_range": list(fr) if fr is not None else None,
            }
        )
    for r, names in writes.items():
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise CheckpointError(f"saving {ckpt}: rank {r} holds several pieces of {dup}; use one state key per piece")
    return tensors, writes


def _shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def release_staging_buffers() -> None:
    """Free the CPU buffers kept for reuse by asynchronous saves (after waiting for pending saves)."""
    finalize()
    _STAGING.clear()


def save_checkpoint(
    save_dir: str,
    iteration: int,
    state: Mapping[str, torch.Tensor | ShardedTensor],
    *,
    extra: Mapping[str, Any] | None = None,
    layout: Mapping[str, Any] | None = None,
    async_save: bool = False,
    background_snapshot: bool = False,
    keep_last: int | None = None,
) -> SaveHandle:
    """Save ``state`` as checkpoint ``save_dir/iter_{iteration:07d}`` and point ``save_dir/latest`` at it.

    Collective when ``torch.distributed`` is initialised (every rank calls it with its own
    ``state``; ``save_dir`` must be a file system shared by all ranks); works in one process too.

    Args:
        save_dir: root directory holding ``iter_*`` checkpoints and ``latest``.
        iteration: number of completed iterations the state corresponds to (Megatron numbering).
        state: name -> plain tensor (replicated: identical on every rank holding it) or
            :class:`ShardedTensor` (this rank's piece of a global tensor).
        extra: JSON-able training state (iteration counters, scheduler, RNG states as numbers or
            lists, sampler, config), returned by :func:`load_checkpoint`. Taken from rank 0.
        layout: JSON-able description of the parallel layout saved from (recorded, informative).
        async_save: copy the state to CPU memory and write it in a background thread; call
            ``handle.wait()``, :func:`finalize`, or the next save/load waits for it.
        background_snapshot: with ``async_save``, return before the copy to CPU memory is made:
            the background thread makes it (on CUDA, on a side stream into pinned memory) while
            the caller goes on. The caller MUST then call :func:`wait_for_snapshot` (or
            ``handle.wait_snapshot()``) before modifying any saved tensor in place, e.g. right
            before ``optimizer.step()``; a modification before that may reach the checkpoint.
            The next save, load and :func:`finalize` wait for the copy too. Off by default: the
            call then returns only once the copy is made, so nothing is required of the caller.
        keep_last: after committing, delete all but this many newest checkpoints (by iteration;
            the one just saved is always kept). ``None`` keeps everything.

    Returns:
        A :class:`SaveHandle` (already finished unless ``async_save``).

    Raises:
        ValueError: bad arguments (negative iteration, non-JSON ``extra``, bad ``keep_last``,
            ``background_snapshot`` without ``async_save``).
        CheckpointError: a state value that is not a tensor (on any rank), inconsistent
            descriptions across ranks, an unwritable ``save_dir``, or a write/commit failure
            (for asynchronous saves, raised by ``wait()``).
    """
    finalize()
    if not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"save_checkpoint: iteration must be a non-negative int, got {iteration!r}")
    if background_snapshot and not async_save:
        raise ValueError("save_checkpoint: background_snapshot=True needs async_save=True")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"save_checkpoint: keep_last must be None or an int >= 1, got {keep_last!r}")
    try:
        extra_json = json.loads(json.dumps(dict(extra or {}), allow_nan=False))
        layout_json = json.loads(json.dumps(dict(layout or {}), allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ValueError(f"save_checkpoint: extra/layout must be JSON-serialisable (lists, numbers, strings): {e}") from e

    grp = _dist.group()
    rank, world = _dist.rank(), _dist.world_size()
    ckpt, tmp = checkpoint_dir(save_dir, iteration), temp_dir(save_dir, iteration)
    # Local mistakes travel with the gathered descriptions so that every rank raises, none hangs.
    mine: list[tuple] | str
    try:
        pieces = {name: _describe(name, v) for name, v in state.items()}
        mine = [
            (name, p.global_shape, dtype_name(p.local.dtype), p.global_offset, p.local_shape, p.flat_range, p.num_replicas)
            for name, p in pieces.items()
            if p.flat_range is None or p.flat_range[0] < p.flat_range[1]
        ]
        odd = sorted({p.local.device.type for p in pieces.values()} - {"cpu", "cuda"})
        if background_snapshot and odd:
            raise ValueError(f"background_snapshot supports CPU and CUDA tensors, not {odd}; pass background_snapshot=False")
    except ValueError as e:
        mine = f"rank {rank}: {e}"
    gathered = _dist.all_gather(mine, grp)
    bad = [g for g in gathered if isinstance(g, str)]
    if bad:
        raise CheckpointError(f"saving {ckpt}: invalid state on {'; '.join(bad)}")
    tensors, writes = _plan(gathered, ckpt)
    validate_metadata(_metadata(iteration, {}, tensors, {}, {}, world, files_placeholder=True), ckpt)

    prep_error = None
    if rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            _clean_stale(save_dir)
            os.makedirs(tmp)
        except OSError as e:
            prep_error = f"cannot create {tmp}: {e}"
    prep_error = _dist.broadcast(prep_error, grp)  # also the barrier before anyone writes into tmp
    if prep_error is not None:
        raise CheckpointError(f"saving {ckpt}: {prep_error}")

    if async_save:  # only keep buffers of tensors still saved
        live = {(n, tuple(p.local.shape), p.local.dtype, p.local.device.type) for n, p in pieces.items()}
        for key in [k for k in _STAGING if k not in live]:
            del _STAGING[key]
    handle = SaveHandle(ckpt, iteration)
    mine_to_write = writes.get(rank, [])
    if background_snapshot:
        srcs = {name: pieces[name].local.detach() for name in mine_to_write}
        items = [(name, _staging(name, t, keep=True)) for name, t in srcs.items()]
        handle._copy = _SnapshotCopy([(out, srcs[name]) for name, out in items])
        srcs.clear()  # the copy tasks hold what they need; the state is not referenced longer
    else:
        items = [(name, _snapshot(name, pieces[name].local, copy=async_save)) for name in mine_to_write]
        if any(t.is_pinned() for _, t in items):
            torch.cuda.current_stream().synchronize()  # the pinned copies were issued non_blocking

    def take_snapshot() -> None:
        copy = handle._copy
        if copy is not None:
            _step("before_snapshot")
            copy.run_device()
            copy.run()
            copy.done.wait()
            copy.release()
            if copy.error is not None:
                raise copy.error

    def finish() -> None:
        try:
            if async_save:
                # The copy runs at normal priority (it competes with training only until the
                # caller's wait_for_snapshot); the writing that follows yields the cores.
                _write_and_commit(save_dir, iteration, tmp, ckpt, items, tensors, extra_json, layout_json, world, rank,
                                  grp, keep_last, before_write=lambda: (take_snapshot(), _lower_priority()))
            else:
                _write_and_commit(save_dir, iteration, tmp, ckpt, items, tensors, extra_json, layout_json, world, rank,
                                  grp, keep_last)
        except BaseException as e:  # re-raised by wait(); never swallowed
            handle._error = e

    if async_save:
        handle._thread = threading.Thread(target=finish, name=f"mg-ckpt-save-{iteration}")
        handle._thread.start()
        _PENDING.append(handle)
    else:
        finish()
        handle.wait()
    return handle


def _lower_priority() -> None:
    # Linux applies nice values per thread (threads it creates inherit it): the background writer
    # and its hashing thread then yield the CPU to the training loop. Best effort elsewhere.
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


def _metadata(iteration, state, tensors, layout, files, world, files_placeholder=False) -> dict[str, Any]:
    if files_placeholder:
        files = {p["file"]: {"size": 0, CHECKSUM: ""} for t in tensors.values() for p in t["pieces"]}
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "iteration": iteration,
        "world_size": world,
        "layout": layout,
        "state": state,
        "files": files,
        "tensors": tensors,
    }


def _write_and_commit(
    save_dir, iteration, tmp, ckpt, items, tensors, extra, layout, world, rank, grp, keep_last, before_write=None
) -> None:
    result: Any
    try:
        result = None
        if before_write is not None:
            before_write()  # the background snapshot: a failure here fails the save on every rank
        _step("before_write")
        if items:
            info = write_safetensors(os.path.join(tmp, _shard_name(rank)), items, checksum=CHECKSUM)
            result = (_shard_name(rank), info.entry())
        _step("after_shard")
    except BaseException as e:
        result = f"rank {rank} failed writing {tmp}/{_shard_name(rank)}: {e!r}"
    items.clear()  # release the CPU copies as soon as they are on disk
    gathered = _dist.all_gather(result, grp)
    outcome: str | None = None
    if rank == 0:
        errors = [g for g in gathered if isinstance(g, str)]
        if errors:
            outcome = "; ".join(errors)
        else:
            try:
                files = dict(g for g in gathered if g is not None)
                meta = _metadata(iteration, extra, tensors, layout, files, world)
                with open(os.path.join(tmp, METADATA_FILE), "w") as f:
                    json.dump(meta, f, indent=1)
                    f.flush()
                    os.fsync(f.fileno())
                fsync_dir(tmp)
                _step("before_rename")
                _commit(save_dir, tmp, ckpt)
                _step("after_rename")
                write_latest(save_dir, iteration)
                _step("after_latest")
                if keep_last is not None:
                    _retain(save_dir, iteration, keep_last)
            except BaseException as e:
                outcome = f"committing {ckpt} failed: {e!r}"
    outcome = _dist.broadcast(outcome, grp)
    if outcome is not None:
        raise CheckpointError(f"saving checkpoint {ckpt}: {outcome}")


def _commit(save_dir: str, tmp: str, ckpt: str) -> None:
    if os.path.exists(ckpt):
        # Re-saving an iteration: move the old one aside first; rename cannot replace a non-empty dir.
        trash = os.path.join(save_dir, f".trash_{os.path.basename(ckpt)}")
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(ckpt, trash)
        os.rename(tmp, ckpt)
        fsync_dir(save_dir)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, ckpt)
        fsync_dir(save_dir)


def _clean_stale(save_dir: str) -> None:
    for name in os.listdir(save_dir):
        if name.startswith((".tmp_iter_", ".trash_", "latest.tmp")):
            path = os.path.join(save_dir, name)
            # A retention thread of an earlier save may be deleting the same trash concurrently.
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass


def _retain(save_dir: str, just_saved: int, keep_last: int) -> None:
    others = [it for it in list_checkpoints(save_dir) if it != just_saved]
    doomed = others[: max(0, len(others) - (keep_last - 1))]
    trash = []
    for it in doomed:
        path = checkpoint_dir(save_dir, it)
        # Rename first so that a crash mid-deletion never leaves a half-deleted iter_N that looks
        # valid; the deletion itself runs in the background (leftovers are removed by the next save).
        trash.append(os.path.join(save_dir, f".trash_{os.path.basename(path)}"))
        os.rename(path, trash[-1])
    if doomed:
        fsync_dir(save_dir)
        threading.Thread(
            target=lambda: [shutil.rmtree(t, ignore_errors=True) for t in trash], name="mg-ckpt-retention", daemon=True
        ).start()
