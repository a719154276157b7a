"""The on-disk half of a save: who writes which piece, and the atomic commit of the files written.

Everything here is a function of its arguments (the coordination group included); the state of
asynchronous saves lives in :class:`mg_ckpt.save.CheckpointSaver`. The steps of the commit call
``step(name)`` so that tests can inject crashes between them.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import zlib
from collections.abc import Callable
from typing import Any

from mg_ckpt import _dist
from mg_ckpt._io import fsync_dir, write_safetensors
from mg_ckpt.errors import CheckpointError
from mg_ckpt.metadata import (
    FORMAT_NAME,
    FORMAT_VERSION,
    METADATA_FILE,
    checkpoint_dir,
    list_checkpoints,
    write_latest,
)


def plan(descs: list[list[tuple]], ckpt: str) -> tuple[dict[str, Any], dict[int, list[str]]]:
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
                "file": shard_name(writer),
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


def shard_name(rank: int) -> str:
    """The shard file written by ``rank``."""
    return f"rank_{rank:05d}.safetensors"


def lower_priority() -> None:
    """Lower the calling thread's CPU priority (best effort)."""
    # Linux applies nice values per thread (threads it creates inherit it): the background writer
    # and its hashing thread then yield the CPU to the training loop. Best effort elsewhere.
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


def metadata(iteration, state, tensors, layout, files, world, placeholder_checksum: str | None = None) -> dict[str, Any]:
    """The ``metadata.json`` document; with ``placeholder_checksum``, empty entries for the planned files."""
    if placeholder_checksum is not None:
        files = {p["file"]: {"size": 0, placeholder_checksum: ""} for t in tensors.values() for p in t["pieces"]}
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


def write_and_commit(
    save_dir, iteration, tmp, ckpt, items, tensors, extra, layout, world, rank, grp, keep_last, *,
    checksum: str, step: Callable[[str], None], before_write: Callable[[], Any] | None = None,
) -> None:
    """Steps 4-5 of the protocol (see :mod:`mg_ckpt.save`): write this rank's shard, commit on rank 0.

    Collective over ``grp``; every rank raises the same :class:`CheckpointError` on failure.
    """
    result: Any
    try:
        result = None
        if before_write is not None:
            before_write()  # the background snapshot: a failure here fails the save on every rank
        step("before_write")
        if items:
            info = write_safetensors(os.path.join(tmp, shard_name(rank)), items, checksum=checksum)
            result = (shard_name(rank), info.entry())
        step("after_shard")
    except BaseException as e:
        result = f"rank {rank} failed writing {tmp}/{shard_name(rank)}: {e!r}"
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
                meta = metadata(iteration, extra, tensors, layout, files, world)
                with open(os.path.join(tmp, METADATA_FILE), "w") as f:
                    json.dump(meta, f, indent=1)
                    f.flush()
                    os.fsync(f.fileno())
                fsync_dir(tmp)
                step("before_rename")
                commit(save_dir, tmp, ckpt)
                step("after_rename")
                write_latest(save_dir, iteration)
                step("after_latest")
                if keep_last is not None:
                    retain(save_dir, iteration, keep_last)
            except BaseException as e:
                outcome = f"committing {ckpt} failed: {e!r}"
    outcome = _dist.broadcast(outcome, grp)
    if outcome is not None:
        raise CheckpointError(f"saving checkpoint {ckpt}: {outcome}")


def commit(save_dir: str, tmp: str, ckpt: str) -> None:
    """Rename the complete ``tmp`` to ``ckpt`` (moving an existing one aside first), durably."""
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


def clean_stale(save_dir: str) -> None:
    """Remove temporary and trash entries left by earlier (crashed) saves."""
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


def retain(save_dir: str, just_saved: int, keep_last: int) -> None:
    """Keep ``just_saved`` and the ``keep_last - 1`` next newest checkpoints; trash the others."""
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
