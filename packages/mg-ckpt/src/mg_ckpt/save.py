"""Saving: plan who writes which piece, write shards into a hidden directory, commit atomically.

Protocol (every rank, collectively when ``torch.distributed`` is initialised):

1. wait for the saver's previous asynchronous save (re-raising its failure);
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
:meth:`CheckpointSaver.wait_for_snapshot` before it next modifies the saved tensors (the
optimizer step).

What lives from one save to the next (the saves still running, the staging buffers, the
coordination group) belongs to a :class:`CheckpointSaver` that the caller creates and closes.
The module-level functions (:func:`save_checkpoint`, :func:`wait_for_snapshot`,
:func:`finalize`, :func:`release_staging_buffers`) are the convenience path: they act on one
default saver, created by the first ``save_checkpoint`` or ``load_checkpoint`` (collectively, as
those calls are) and replaced when ``torch.distributed`` is re-initialised.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from mg_ckpt import _commit, _dist
from mg_ckpt._io import DEFAULT_CHECKSUM, dtype_name
from mg_ckpt._snapshot import StagingBuffers, _SnapshotCopy
from mg_ckpt.errors import CheckpointError
from mg_ckpt.metadata import checkpoint_dir, temp_dir, validate_metadata
from mg_ckpt.sharded import ShardedTensor

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "CheckpointSaver",
    "SaveHandle",
    "default_saver",
    "finalize",
    "release_staging_buffers",
    "save_checkpoint",
    "wait_for_snapshot",
]

CHECKSUM = DEFAULT_CHECKSUM
"""Checksum algorithm of the shard files written (recorded under its name in ``metadata.json``)."""

# Test hook for crash injection: called with the name of each commit step (see _step).
_fault_hook: Callable[[str], None] | None = None


def _step(name: str) -> None:
    if _fault_hook is not None:
        _fault_hook(name)


class SaveHandle:
    """A save in progress (asynchronous) or done (synchronous).

    ``wait()`` blocks until the checkpoint is committed and re-raises any failure of the
    background write or commit (on every call, so it cannot be lost).
    """

    def __init__(self, path: str, iteration: int, saver: CheckpointSaver | None = None) -> None:
        self.path = path
        """Final directory of the checkpoint (``save_dir/iter_N``)."""
        self.iteration = iteration
        """The iteration saved."""
        self._saver = saver  # keeps the saver (and its pending list) alive while the save runs
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._copy: _SnapshotCopy | None = None

    def done(self) -> bool:
        """True once the save finished (committed or failed)."""
        return self._thread is None or not self._thread.is_alive()

    def snapshot_done(self) -> bool:
        """True once the saved tensors are no longer read: the state may be modified in place.

        Always true when the save call returns, except with ``background_snapshot=True``.
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
        if self._saver is not None:  # the caller now sees the outcome; later saves need not report it again
            self._saver._forget(self)
        if self._error is not None:
            if isinstance(self._error, CheckpointError):
                raise self._error
            raise CheckpointError(f"saving {self.path} failed: {self._error!r}") from self._error


def _describe(name: str, value: torch.Tensor | ShardedTensor) -> ShardedTensor:
    if isinstance(value, ShardedTensor):
        return value
    if isinstance(value, torch.Tensor):
        return ShardedTensor(value, tuple(value.shape))
    raise ValueError(f"save_checkpoint: state[{name!r}] must be a torch.Tensor or ShardedTensor, got {type(value).__name__}")


class CheckpointSaver:
    """Saves checkpoints and owns what asynchronous saves keep between calls.

    A saver holds three things, none of them hidden in module state:

    * the **pending saves**: asynchronous saves still writing in the background, or finished but
      not yet waited for (so that a failure is reported once, to someone). The next :meth:`save`,
      :meth:`wait`, :meth:`close` and ``load_checkpoint(..., saver=self)`` wait for them;
    * the **staging buffers**: the CPU (pinned, for CUDA tensors) copies an asynchronous save
      writes from, reused by the next asynchronous save of the same tensors (allocating and
      first-touching a state-sized buffer costs more than the copy), freed by :meth:`close`;
    * the **coordination group**: a gloo group of every rank over which the ranks agree on the plan
      and the commit. Being used by checkpointing only, it serves the background thread while the
      training loop runs collectives on its own groups.

    Create one per training run, after ``torch.distributed.init_process_group`` (or without it in a
    single process), and close it at the end (``with CheckpointSaver() as saver: ...``). If a
    saver with pending saves is never closed, an exit handler waits for them and writes one
    warning line on stderr.

    Args:
        group: the coordination group, created once by the caller with
            ``torch.distributed.new_group(backend="gloo")`` (every rank, used by nothing else). With
            ``None`` (default) the constructor creates that group itself when ``torch.distributed``
            is initialised, which makes the constructor **collective**: every rank must construct
            its saver at the same point of its sequence of ``new_group`` calls. Saves never create
            a group. Must be ``None`` in a single process.

    Raises:
        ValueError: ``group`` given without ``torch.distributed``, not holding every rank, or not
            a gloo group.
    """

    def __init__(self, group: ProcessGroup | None = None) -> None:
        if group is not None:
            _dist.check_coordination_group(group, "CheckpointSaver(group=...)")
        else:
            group = _dist.new_coordination_group()
        self._group = group
        self._world = _dist.world()  # the job it was made for: a re-initialised job needs a new saver
        self._pending: list[SaveHandle] = []
        self._staging = StagingBuffers()
        self._closed = False
        _PROCESS.track(self)

    @property
    def group(self) -> ProcessGroup | None:
        """The coordination process group (``None`` in a single process)."""
        return self._group

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def __enter__(self) -> CheckpointSaver:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        try:  # the block's own exception goes on; a save failure must not replace it
            self.close()
        except CheckpointError as e:
            warnings.warn(f"mg-ckpt: a pending save failed while the with block raised {exc_type.__name__}: {e}",
                          RuntimeWarning, stacklevel=2)

    def _begin(self, what: str) -> ProcessGroup | None:
        """Check the saver can run a collective now, wait for its pending saves; its group.

        Raises:
            CheckpointError: the saver is closed; ``torch.distributed`` was initialised, destroyed
                or re-initialised since it was created; a pending save failed.
        """
        if self._closed:
            raise CheckpointError(f"{what}: this CheckpointSaver is closed; create a new one")
        if self._world is not _dist.world():
            raise CheckpointError(
                f"{what}: torch.distributed was initialised, destroyed or re-initialised since this "
                f"CheckpointSaver was created; create the saver after init_process_group (a new one per job)"
            )
        self.wait()
        return self._group

    def wait_for_snapshot(self) -> None:
        """Block until this saver's pending saves have copied the state they save (``background_snapshot``).

        Call it before modifying saved tensors in place after a ``save(...,
        background_snapshot=True)``, e.g. right before ``optimizer.step()``; forward and backward
        may run before it, as they only read parameters and optimizer state. On CPU the caller
        copies what the background thread has not yet copied, so it never waits longer than a
        blocking copy. Returns at once when no such copy is pending. Never raises: failures come
        from ``SaveHandle.wait``, :meth:`wait`, :meth:`close` or the next save.
        """
        for handle in list(self._pending):
            handle.wait_snapshot()

    def wait(self) -> None:
        """Wait for every pending save of this saver (e.g. before reading its checkpoints).

        Raises:
            CheckpointError: the first failed pending save (the others are still waited for).
        """
        first: BaseException | None = None
        while self._pending:
            handle = self._pending[0]
            try:
                handle.wait()
            except CheckpointError as e:
                first = first or e
        if first is not None:
            raise first

    def release_staging_buffers(self) -> None:
        """Wait for the pending saves (as :meth:`wait`), then free the staging buffers.

        The next asynchronous save allocates them again. Useful between rare saves of a large
        state; :meth:`close` does it too.

        Raises:
            CheckpointError: as :meth:`wait` (the buffers are freed anyway).
        """
        try:
            self.wait()
        finally:
            self._staging.clear()

    def close(self) -> None:
        """Wait for every pending save, free the staging buffers and retire the saver.

        Not collective: each rank waits for its own part of the pending saves (which themselves
        finish collectively). A passed-in group is left to its owner; one the constructor created is
        only dropped (``torch.distributed.destroy_process_group()`` releases it with the others).
        Closing twice is a no-op; :meth:`save` on a closed saver raises.

        Raises:
            CheckpointError: the first failed pending save (all are waited for, the buffers freed
                and the saver closed before it is raised).
        """
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._staging.clear()
            self._closed = True
            self._group = None
            _PROCESS.open.discard(self)

    def _forget(self, handle: SaveHandle) -> None:
        if handle in self._pending:
            self._pending.remove(handle)

    def save(
        self,
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
        It first waits for this saver's pending saves. Its collectives run on :attr:`group`; it
        creates no process group.

        Args:
            save_dir: root directory holding ``iter_*`` checkpoints and ``latest``.
            iteration: number of completed iterations the state corresponds to (Megatron numbering).
            state: name -> plain tensor (replicated: identical on every rank holding it) or
                :class:`ShardedTensor` (this rank's piece of a global tensor).
            extra: JSON-able training state (iteration counters, scheduler, RNG states as numbers or
                lists, sampler, config), returned by :func:`load_checkpoint`. Taken from rank 0.
            layout: JSON-able description of the parallel layout saved from (recorded, informative).
            async_save: copy the state to CPU memory and write it in a background thread; call
                ``handle.wait()``, :meth:`wait` or :meth:`close`, or the next save/load waits for it.
            background_snapshot: with ``async_save``, return before the copy to CPU memory is made:
                the background thread makes it (on CUDA, on a side stream into pinned memory) while
                the caller goes on. The caller MUST then call :meth:`wait_for_snapshot` (or
                ``handle.wait_snapshot()``) before modifying any saved tensor in place, e.g. right
                before ``optimizer.step()``; a modification before that may reach the checkpoint.
                The next save, load, :meth:`wait` and :meth:`close` wait for the copy too. Off by
                default: the call then returns only once the copy is made, so nothing is required of
                the caller.
            keep_last: after committing, delete all but this many newest checkpoints (by iteration;
                the one just saved is always kept). ``None`` keeps everything.

        Returns:
            A :class:`SaveHandle` (already finished unless ``async_save``).

        Raises:
            ValueError: bad arguments (negative iteration, non-JSON ``extra``, bad ``keep_last``,
                ``background_snapshot`` without ``async_save``).
            CheckpointError: a state value that is not a tensor (on any rank), inconsistent
                descriptions across ranks, an unwritable ``save_dir``, or a write/commit failure
                (for asynchronous saves, raised by ``wait()``); a previous asynchronous save that
                failed and was not waited for; a closed saver, or one made for another
                ``torch.distributed`` job.
        """
        grp = self._begin(f"saving into {save_dir}")
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
        tensors, writes = _commit.plan(gathered, ckpt)
        validate_metadata(_commit.metadata(iteration, {}, tensors, {}, {}, world, placeholder_checksum=CHECKSUM), ckpt)

        prep_error = None
        if rank == 0:
            try:
                os.makedirs(save_dir, exist_ok=True)
                _commit.clean_stale(save_dir)
                os.makedirs(tmp)
            except OSError as e:
                prep_error = f"cannot create {tmp}: {e}"
        prep_error = _dist.broadcast(prep_error, grp)  # also the barrier before anyone writes into tmp
        if prep_error is not None:
            raise CheckpointError(f"saving {ckpt}: {prep_error}")

        if async_save:  # only keep buffers of tensors still saved
            self._staging.keep_only({n: p.local for n, p in pieces.items()})
        handle = SaveHandle(ckpt, iteration, self)
        mine_to_write = writes.get(rank, [])
        if background_snapshot:
            srcs = {name: pieces[name].local.detach() for name in mine_to_write}
            items = [(name, self._staging.get(name, t, keep=True)) for name, t in srcs.items()]
            handle._copy = _SnapshotCopy([(out, srcs[name]) for name, out in items])
            srcs.clear()  # the copy tasks hold what they need; the state is not referenced longer
        else:
            items = [(name, self._staging.snapshot(name, pieces[name].local, copy=async_save)) for name in mine_to_write]
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
            # The copy runs at normal priority (it competes with training only until the caller's
            # wait_for_snapshot); the writing that follows yields the cores.
            before_write = (lambda: (take_snapshot(), _commit.lower_priority())) if async_save else None
            try:
                _commit.write_and_commit(save_dir, iteration, tmp, ckpt, items, tensors, extra_json, layout_json, world,
                                         rank, grp, keep_last, checksum=CHECKSUM, step=_step, before_write=before_write)
            except BaseException as e:  # re-raised by wait(); never swallowed
                handle._error = e

        if async_save:
            handle._thread = threading.Thread(target=finish, name=f"mg-ckpt-save-{iteration}")
            handle._thread.start()
            self._pending.append(handle)
        else:
            finish()
            handle.wait()
        return handle


def default_saver() -> CheckpointSaver:
    """The saver behind :func:`save_checkpoint` and ``load_checkpoint`` without ``saver=`` (the convenience path).

    Created on first use, which is collective when ``torch.distributed`` is initialised (it
    creates the coordination group), as the ``save_checkpoint``/``load_checkpoint`` calls that
    need it are. When ``torch.distributed`` was initialised, destroyed or re-initialised since, the
    old default saver is closed (waiting for its saves) and a new one made.

    Raises:
        CheckpointError: a pending save of the replaced default saver failed.
    """
    old = _PROCESS.default
    if old is not None and (old.closed or old._world is not _dist.world()):
        _PROCESS.default = None
        old.close()
    if _PROCESS.default is None:
        _PROCESS.default = CheckpointSaver()
    return _PROCESS.default


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
    """:meth:`CheckpointSaver.save` with the default saver (see :func:`default_saver`).

    The convenience path for scripts and tests: its pending saves are waited for by the next
    ``save_checkpoint``/``load_checkpoint``, :func:`finalize` or :func:`release_staging_buffers`,
    and its ``background_snapshot`` copies by :func:`wait_for_snapshot`. A training loop that
    saves asynchronously should own a :class:`CheckpointSaver` instead. Arguments, result and
    errors are those of :meth:`CheckpointSaver.save` (collective, likewise).
    """
    return default_saver().save(save_dir, iteration, state, extra=extra, layout=layout, async_save=async_save,
                                background_snapshot=background_snapshot, keep_last=keep_last)


def wait_for_snapshot() -> None:
    """:meth:`CheckpointSaver.wait_for_snapshot` of the default saver (no-op when there is none).

    Call it before modifying saved tensors in place after a ``save_checkpoint(...,
    background_snapshot=True)``, e.g. right before ``optimizer.step()``. Never raises.
    """
    if _PROCESS.default is not None:
        _PROCESS.default.wait_for_snapshot()


def finalize() -> None:
    """Wait for every pending save of the default saver (:meth:`CheckpointSaver.wait`; no-op when there is none).

    Call it before exit or before reading checkpoints written with :func:`save_checkpoint`.
    Saves of other :class:`CheckpointSaver` objects are theirs to wait for.

    Raises:
        CheckpointError: the first failed pending save (the others are still waited for).
    """
    if _PROCESS.default is not None:
        _PROCESS.default.wait()


def release_staging_buffers() -> None:
    """Free the default saver's staging buffers after waiting for its pending saves (no-op when there is none).

    Raises:
        CheckpointError: a pending save failed (the buffers are freed anyway).
    """
    if _PROCESS.default is not None:
        _PROCESS.default.release_staging_buffers()


class _ProcessSavers:
    """What mg-ckpt keeps for the whole process, in one object: the default saver of the convenience functions
    (None until one of them needs it, see :func:`default_saver`) and a weak view of every saver not yet closed,
    for the exit handler's last-resort flush only (it owns nothing). The exit handler is registered when the
    first saver is created, not at import."""

    def __init__(self) -> None:
        self.default: CheckpointSaver | None = None
        self.open: weakref.WeakSet[CheckpointSaver] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._exit_handler_registered = False

    def track(self, saver: CheckpointSaver) -> None:
        """Remember ``saver`` until it is closed or collected; registers the exit handler on first use."""
        with self._lock:
            if not self._exit_handler_registered:
                atexit.register(self.flush_at_exit)
                self._exit_handler_registered = True
            self.open.add(saver)

    def flush_at_exit(self) -> None:
        """Last resort: wait for the saves of savers nobody closed (or finalized), saying so in one line on stderr.

        Raises:
            CheckpointError: the first failed save among them (every one is waited for).
        """
        unclosed = [saver for saver in list(self.open) if saver._pending]
        if not unclosed:
            return
        n = sum(len(saver._pending) for saver in unclosed)
        owned = sum(saver is not self.default for saver in unclosed)
        missed = ([f"CheckpointSaver.close(){f' (on {owned} savers)' if owned > 1 else ''}"] if owned else [])
        missed += ["mg_ckpt.finalize()"] if any(saver is self.default for saver in unclosed) else []
        print(f"mg-ckpt: {n} checkpoint save{'s' if n > 1 else ''} still pending at exit: {' and '.join(missed)} "
              f"{'were' if len(missed) > 1 else 'was'} not called; waiting for {'them' if n > 1 else 'it'} now",
              file=sys.stderr, flush=True)
        first: CheckpointError | None = None
        for saver in unclosed:
            try:
                saver.close()
            except CheckpointError as e:
                first = first or e
        if first is not None:
            raise first


_PROCESS = _ProcessSavers()
