"""Loading with resharding: each rank reads exactly the global slices its current layout needs.

Every saved piece and every wanted piece is turned into boxes of global coordinates (flat ranges
become up to ``2 * ndim - 1`` contiguous boxes); each non-empty intersection of a wanted box with
a saved box is copied once: by positioned reads straight into the local tensor when it is made of
long contiguous runs (whole pieces, row shards, flat ranges), else by a strided copy from a
read-only memory map of the shard file (column shards: only the pages holding the slice are read).
Only safetensors and JSON are ever parsed (no pickle).

Verification (``verify=True``) checks every shard file's size and checksum (CRC-32, or SHA-256 for
format version 1) against ``metadata.json``. In a multi-rank load the files are split over the ranks, hashed in a background
thread while the slices are read, and the outcome is shared, so all ranks raise the same error.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from mg_ckpt import _dist
from mg_ckpt._io import as_bytes, file_checksums, member_path, read_header, torch_dtype
from mg_ckpt.errors import CheckpointError
from mg_ckpt.metadata import file_digests, read_metadata, resolve_checkpoint
from mg_ckpt.save import CheckpointSaver, default_saver
from mg_ckpt.sharded import Box, ShardedTensor, flat_range_to_boxes, intersect

__all__ = ["load_checkpoint", "verify_files"]

# Below this many contiguous bytes per run, a strided copy through the map beats one positioned
# read per run: on the development VM one pread of a 4 KiB run costs about as much as mapping and
# copying 16 KiB, and the two only break even around 1 MiB runs (measured: per-run reads 4-8x a
# contiguous read for 1-4 KiB runs, 1.3-1.5x at 64-256 KiB; the map 1.0-1.5x throughout).
_MIN_RUN = 1 << 20
# Same-size integer dtypes, so that any stored dtype (bf16, fp8 included) copies through numpy.
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def verify_files(ckpt: str, meta: Mapping[str, Any], names: list[str] | None = None) -> None:
    """Check size and checksum of the shard files ``names`` (default: all) against the metadata.

    Each file is read once and checked with every algorithm its entry records (``crc32`` or
    ``sha256``, see :data:`mg_ckpt._io.CHECKSUM_ALGORITHMS`).

    Raises:
        CheckpointError: naming the first missing, truncated or corrupted file.
    """
    for fname in sorted(meta["files"]) if names is None else names:
        info = meta["files"][fname]
        path = member_path(ckpt, fname, os.path.join(ckpt, "metadata.json"))
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: shard file is missing") from None
        if size != info["size"]:
            raise CheckpointError(f"{path}: has {size} bytes but metadata.json records {info['size']} (truncated or replaced)")
        want = file_digests(info)
        got = file_checksums(path, list(want))
        for algorithm, digest in want.items():
            if got[algorithm] != digest.lower():
                raise CheckpointError(
                    f"{path}: {algorithm} checksum mismatch (file corrupted); restore it or load another checkpoint"
                )


def _targets(value: ShardedTensor) -> list[tuple[Box, torch.Tensor]]:
    # Boxes of the wanted piece, each with a writable view into the local tensor.
    if value.flat_range is None:
        return [(Box(value.global_offset, value.local_shape), value.local)]
    if not value.local.is_contiguous():
        raise ValueError("load_checkpoint: a ShardedTensor with flat_range needs a contiguous local tensor")
    flat = value.local.view(-1)
    return [(b, flat[b.flat_start : b.flat_start + b.numel].view(b.shape)) for b in value.boxes()]


def _sources(piece: Mapping[str, Any]) -> list[Box]:
    # Saved boxes; flat_start is the index in the stored 1-D tensor (flat pieces) or 0 (blocks).
    off, shape, fr = tuple(piece["offset"]), tuple(piece["shape"]), piece["flat_range"]
    if fr is None:
        return [Box(off, shape)]
    return [
        Box(tuple(o + s for o, s in zip(off, b.start)), b.shape, b.flat_start - fr[0])
        for b in flat_range_to_boxes(fr[0], fr[1], shape)
    ]


class _Reader:
    """Map shard files read-only and hand out tensor views of the stored pieces.

    Each file's header is parsed and bounds-checked (and, once, validated by ``safetensors``
    itself); the stored tensor's shape/dtype must match the metadata. Views are zero-copy: the
    only copy is into the destination, and only the pages of the slices read are touched.
    """

    def __init__(self, ckpt: str, meta: Mapping[str, Any]) -> None:
        self.ckpt, self.meta = ckpt, meta
        self.files: dict[str, tuple[dict, int, np.memmap]] = {}
        self.handles: dict[str, Any] = {}

    def tensor(self, name: str, piece: Mapping[str, Any]) -> torch.Tensor:
        fname, key = piece["file"], piece["key"]
        path = member_path(self.ckpt, fname, os.path.join(self.ckpt, "metadata.json"))
        if fname not in self.files:
            if not os.path.isfile(path):
                raise CheckpointError(f"{path}: shard file is missing (needed for tensor {name!r})")
            size = os.path.getsize(path)
            if size != self.meta["files"][fname]["size"]:
                raise CheckpointError(
                    f"{path}: has {size} bytes but metadata.json records {self.meta['files'][fname]['size']} "
                    f"(truncated or replaced; needed for tensor {name!r})"
                )
            header, data_start = read_header(path)
            try:
                with safe_open(path, framework="pt") as f:
                    f.keys()
            except Exception as e:
                raise CheckpointError(f"{path}: unreadable safetensors file ({e})") from None
            self.files[fname] = (header, data_start, np.memmap(path, dtype=np.uint8, mode="r"))
        header, data_start, mm = self.files[fname]
        entry = header.get(key)
        if entry is None:
            raise CheckpointError(f"{path}: tensor {key!r} (for {name!r}) is not in the file")
        fr = piece["flat_range"]
        want = [fr[1] - fr[0]] if fr is not None else list(piece["shape"])
        if entry["shape"] != want or entry["dtype"] != self.meta["tensors"][name]["dtype"]:
            raise CheckpointError(
                f"{path}: tensor {key!r} is {entry['dtype']}{entry['shape']} but metadata.json says "
                f"{self.meta['tensors'][name]['dtype']}{want}"
            )
        b, e = entry["data_offsets"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the map is read-only; we only ever read from it
            raw = torch.from_numpy(mm[data_start + b : data_start + e])
        return raw.view(torch_dtype(entry["dtype"], path)).view(want)

    def read_into(self, piece: Mapping[str, Any], src: torch.Tensor, dst: torch.Tensor) -> bool:
        """Copy the stored slice ``src`` (a view of the map) into contiguous CPU ``dst`` with positioned reads.

        Used when ``src`` is made of contiguous runs of at least ``_MIN_RUN`` bytes (whole pieces,
        row slices, flat ranges, wide column slices): each run is one ``preadv`` straight into
        ``dst`` (a kernel copy, no page faults on the map), as fast as a plain sequential read.
        Returns False (nothing read) for shorter runs, which are copied through the map instead.
        """
        shape, stride = list(src.shape), list(src.stride())
        j, run = len(shape), 1
        while j > 0 and (shape[j - 1] == 1 or stride[j - 1] == run):
            run *= shape[j - 1]
            j -= 1
        size = src.element_size()
        if run * size < _MIN_RUN and j > 0:
            return False
        fname, key = piece["file"], piece["key"]
        header, data_start, _ = self.files[fname]
        f = self.handles.get(fname)
        if f is None:
            f = self.handles[fname] = open(os.path.join(self.ckpt, fname), "rb", buffering=0)  # noqa: SIM115
        base = data_start + header[key]["data_offsets"][0] + src.storage_offset() * size
        out = as_bytes(dst)
        nbytes = run * size
        for k, idx in enumerate(itertools.product(*(range(n) for n in shape[:j]))):
            pos = base + sum(i * st for i, st in zip(idx, stride)) * size
            view = out[k * nbytes : (k + 1) * nbytes]
            got = 0
            while got < nbytes:
                n = os.preadv(f.fileno(), [view[got:]], pos + got)
                if not n:
                    raise CheckpointError(f"{self.ckpt}/{fname}: truncated while reading tensor {key!r}")
                got += n
        return True

    def close(self) -> None:
        # Dropping the maps unmaps them once the last view is gone (an explicit close would fail
        # while an exception's traceback still holds a view).
        self.files.clear()
        for f in self.handles.values():
            f.close()
        self.handles.clear()


def _read_box(stored: torch.Tensor, src: Box, flat: bool, start: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """A view of the sub-box ``[start, start+shape)`` (global coordinates) of saved box ``src``."""
    rel = [s - o for s, o in zip(start, src.start)]
    if not flat:
        return stored[tuple(slice(r, r + n) for r, n in zip(rel, shape))]
    # src is a contiguous run of the stored 1-D tensor: view it as the box, then narrow.
    box = stored[src.flat_start : src.flat_start + src.numel].view(src.shape)
    return box[tuple(slice(r, r + n) for r, n in zip(rel, shape))]


def _copy_from_map(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a (possibly strided) view of a shard's memory map into ``dst``, casting if dtypes differ.

    A same-dtype copy into CPU memory goes through ``numpy.copyto`` on same-size integer views: one
    thread walks the rows in order, so the map's pages are faulted in sequence (measured 1.1-1.5x
    faster than torch's multi-threaded strided copy, whose threads contend on the page faults).
    """
    if dst.device.type == "cpu" and dst.dtype == src.dtype:
        as_int = _INT_OF_SIZE[dst.element_size()]
        np.copyto(dst.detach().view(as_int).numpy(), src.view(as_int).numpy(), casting="no")
    else:
        dst.copy_(src)


def _fill(name: str, value: ShardedTensor, entry: Mapping[str, Any], reader: _Reader) -> None:
    covered = 0
    targets = _targets(value)
    for piece in entry["pieces"]:
        flat = piece["flat_range"] is not None
        for src in _sources(piece):
            for tgt, view in targets:
                hit = intersect(tgt, src)
                if hit is None:
                    continue
                start, shape = hit
                data = _read_box(reader.tensor(name, piece), src, flat, start, shape)
                dst = view[tuple(slice(s - t, s - t + n) for s, t, n in zip(start, tgt.start, shape))]
                direct = dst.is_contiguous() and dst.dtype == data.dtype and dst.device.type == "cpu"
                if not (direct and reader.read_into(piece, data, dst)):
                    _copy_from_map(dst, data)
                covered += math.prod(shape)
    want = sum(b.numel for b, _ in targets)
    if covered != want:
        raise CheckpointError(
            f"{reader.ckpt}: tensor {name!r}: the checkpoint's pieces cover {covered} of the {want} elements "
            f"this rank needs (inconsistent metadata)"
        )


def load_checkpoint(
    path: str,
    state_template: Mapping[str, torch.Tensor | ShardedTensor],
    *,
    verify: bool = True,
    strict: bool = True,
    saver: CheckpointSaver | None = None,
) -> dict[str, Any]:
    """Fill the tensors of ``state_template`` in place from a checkpoint saved at any parallel layout.

    Collective when ``torch.distributed`` is initialised. Each rank reads only the global slices
    its own pieces cover; values are cast to the template's dtype. On error the template's
    contents are unspecified.

    Args:
        path: a checkpoint directory (``.../iter_N``) or a save directory (its ``latest`` is used).
        state_template: name -> tensor (the whole global tensor) or :class:`ShardedTensor` (this
            rank's piece, described as when saving) to fill.
        verify: check every shard file's size and checksum (split over ranks) before returning.
        strict: a template name missing from the checkpoint is an error; otherwise it is left
            untouched and a warning names it.
        saver: the :class:`CheckpointSaver` whose pending saves are waited for first and whose
            group the ranks coordinate over. Pass the training loop's own saver; ``None`` uses the
            default saver of :func:`save_checkpoint` (created here if none exists yet, collectively).

    Returns:
        The ``extra`` training state given to :func:`save_checkpoint` (with ``"iteration"`` set).

    Raises:
        CheckpointError: no checkpoint at ``path``; missing/corrupted/truncated shard files;
            malicious or inconsistent metadata; a tensor missing (strict) or of another global
            shape — naming the file and tensor. All ranks raise when any rank fails. Also a failed
            pending save of ``saver``, or a closed ``saver``.
    """
    grp = (saver if saver is not None else default_saver())._begin(f"loading {path}")
    rank, world = _dist.rank(), _dist.world_size()
    error: str | None = None
    verify_error: list[str] = []
    checker: threading.Thread | None = None
    reader: _Reader | None = None
    extra: dict[str, Any] = {}
    try:
        ckpt = resolve_checkpoint(path)
        meta = read_metadata(ckpt)
        extra = dict(meta["state"])
        extra.setdefault("iteration", meta["iteration"])
        if verify:
            mine = [f for i, f in enumerate(sorted(meta["files"])) if i % world == rank]

            def check() -> None:
                try:
                    verify_files(ckpt, meta, mine)
                except CheckpointError as e:
                    verify_error.append(str(e))

            checker = threading.Thread(target=check, name="mg-ckpt-verify", daemon=True)
            checker.start()
        reader = _Reader(ckpt, meta)
        missing = []
        for name, v in state_template.items():
            value = v if isinstance(v, ShardedTensor) else ShardedTensor(v, tuple(v.shape))
            entry = meta["tensors"].get(name)
            if entry is None:
                missing.append(name)
                continue
            if list(value.global_shape) != entry["shape"]:
                raise CheckpointError(
                    f"{ckpt}: tensor {name!r} has global shape {entry['shape']} in the checkpoint but "
                    f"{list(value.global_shape)} in the model; check the model config matches the checkpoint"
                )
            with torch.no_grad():
                _fill(name, value, entry, reader)
        if missing:
            msg = f"{ckpt}: tensors {missing[:8]}{' ...' if len(missing) > 8 else ''} are not in the checkpoint"
            if strict:
                raise CheckpointError(msg + " (pass strict=False to skip them)")
            warnings.warn(msg + "; left unchanged", stacklevel=2)
    except CheckpointError as e:
        error = str(e)
    except Exception as e:
        error = f"loading {path} failed on rank {rank}: {e!r}"
    finally:
        if checker is not None:
            checker.join()
        if reader is not None:
            reader.close()
    if error is None and verify_error:
        error = verify_error[0]
    errors = [e for e in _dist.all_gather(error, grp) if e is not None]
    if errors:
        raise CheckpointError(errors[0])
    return extra
