"""The on-disk layout: directory names, the ``latest`` pointer and ``metadata.json`` (schema + validation).

See the package README for the format specification; this module is its executable form.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

from mg_ckpt._io import CHECKSUM_ALGORITHMS, member_path, torch_dtype, write_text_atomic
from mg_ckpt.errors import CheckpointError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "METADATA_FILE",
    "READABLE_VERSIONS",
    "checkpoint_dir",
    "file_digests",
    "latest_iteration",
    "list_checkpoints",
    "read_metadata",
    "resolve_checkpoint",
]

FORMAT_NAME = "mg-ckpt"
FORMAT_VERSION = 2
"""Version written. 2: each file's checksum is keyed by its algorithm (``crc32`` for new files)."""
READABLE_VERSIONS = (1, 2)
"""Versions read. 1: every file entry holds ``sha256``; otherwise identical to 2."""
METADATA_FILE = "metadata.json"
LATEST_FILE = "latest"
_ITER_RE = re.compile(r"iter_(\d{7,})")


def checkpoint_dir(save_dir: str, iteration: int) -> str:
    """``save_dir/iter_{iteration:07d}``: the directory holding the state after ``iteration`` iterations."""
    return os.path.join(save_dir, f"iter_{iteration:07d}")


def temp_dir(save_dir: str, iteration: int) -> str:
    """The hidden directory a checkpoint is written into before it is renamed into place."""
    return os.path.join(save_dir, f".tmp_iter_{iteration:07d}")


def list_checkpoints(save_dir: str) -> list[int]:
    """Iterations of the committed checkpoints under ``save_dir`` (directories ``iter_N`` holding metadata), sorted."""
    out = []
    try:
        names = os.listdir(save_dir)
    except FileNotFoundError:
        return []
    for name in names:
        m = _ITER_RE.fullmatch(name)
        if m and os.path.isfile(os.path.join(save_dir, name, METADATA_FILE)):
            out.append(int(m.group(1)))
    return sorted(out)


def latest_iteration(save_dir: str) -> int | None:
    """The iteration named by ``save_dir/latest``, else the newest committed ``iter_N``, else ``None``.

    Raises:
        CheckpointError: ``latest`` exists but does not hold an iteration number.
    """
    path = os.path.join(save_dir, LATEST_FILE)
    try:
        with open(path) as f:
            text = f.read().strip()
    except FileNotFoundError:
        found = list_checkpoints(save_dir)
        return found[-1] if found else None
    if not text.isdigit():
        raise CheckpointError(f"{path}: expected an iteration number, found {text[:40]!r}; fix or delete the file")
    return int(text)


def write_latest(save_dir: str, iteration: int) -> None:
    """Atomically point ``save_dir/latest`` at ``iteration``."""
    write_text_atomic(os.path.join(save_dir, LATEST_FILE), f"{iteration}\n")


def resolve_checkpoint(path: str) -> str:
    """The checkpoint directory meant by ``path``: itself if it holds ``metadata.json``, else its latest checkpoint.

    Raises:
        CheckpointError: nothing to load at ``path``, or ``latest`` names a missing checkpoint.
    """
    if os.path.isfile(os.path.join(path, METADATA_FILE)):
        return path
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint or save directory")
    it = latest_iteration(path)
    if it is None:
        raise CheckpointError(f"{path}: no checkpoint found (no 'latest' file and no iter_* directory with {METADATA_FILE})")
    ckpt = checkpoint_dir(path, it)
    if not os.path.isfile(os.path.join(ckpt, METADATA_FILE)):
        raise CheckpointError(f"{path}/latest names iteration {it} but {ckpt}/{METADATA_FILE} does not exist")
    return ckpt


def read_metadata(ckpt: str) -> dict[str, Any]:
    """Read and validate ``ckpt/metadata.json`` (see :func:`validate_metadata`).

    Raises:
        CheckpointError: missing, unparsable or inconsistent metadata, naming the file and entry.
    """
    path = member_path(ckpt, METADATA_FILE, ckpt)
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; {ckpt} is not a complete checkpoint") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt JSON ({e})") from None
    validate_metadata(meta, ckpt)
    return meta


def _ints(value: Any, what: str, n: int | None = None) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise CheckpointError(f"{what}: expected a list of non-negative integers, got {value!r}")
    if n is not None and len(value) != n:
        raise CheckpointError(f"{what}: expected {n} entries, got {len(value)}")
    return value


def file_digests(info: Any) -> dict[str, str]:
    """``{algorithm: hex digest}`` of the checksums a ``files`` entry records that this reader knows."""
    if not isinstance(info, dict):
        return {}
    return {a: info[a] for a in CHECKSUM_ALGORITHMS if isinstance(info.get(a), str)}


def validate_metadata(meta: Any, ckpt: str) -> None:
    """Check ``metadata.json`` content: format/version, file names, and that each tensor's pieces tile it.

    Every piece must lie inside its tensor; flat ranges of a block must tile the block exactly;
    the blocks' volumes must add up to the tensor's size; every file a piece names must be listed
    under ``files`` with a size and a checksum of a known algorithm (``sha256`` in version 1), and
    be a plain name inside ``ckpt``.

    Raises:
        CheckpointError: the first inconsistency found, naming the tensor or file.
    """
    where = os.path.join(ckpt, METADATA_FILE)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{where}: not an {FORMAT_NAME} metadata file")
    if meta.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{where}: format version {meta.get('version')!r} is not supported (this mg-ckpt reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}); upgrade mg-ckpt"
        )
    for key, typ in (("iteration", int), ("files", dict), ("tensors", dict), ("state", dict), ("layout", dict)):
        if not isinstance(meta.get(key), typ):
            raise CheckpointError(f"{where}: field {key!r} missing or not a {typ.__name__}")
    for fname, info in meta["files"].items():
        member_path(ckpt, fname, where)
        if not isinstance(info, dict) or not isinstance(info.get("size"), int) or not file_digests(info):
            raise CheckpointError(
                f"{where}: files[{fname!r}] needs an integer 'size' and a checksum string under one of the keys "
                f"{list(CHECKSUM_ALGORITHMS)}"
            )
        if meta["version"] == 1 and "sha256" not in info:
            raise CheckpointError(f"{where}: files[{fname!r}] needs a 'sha256' string (format version 1)")
    for name, t in meta["tensors"].items():
        what = f"{where}: tensor {name!r}"
        if not isinstance(t, dict) or not isinstance(t.get("pieces"), list):
            raise CheckpointError(f"{what}: needs 'shape', 'dtype' and a list of 'pieces'")
        shape = _ints(t.get("shape"), f"{what} shape")
        torch_dtype(t.get("dtype"), what)
        blocks: dict[tuple, list[tuple[int, int] | None]] = {}
        for i, p in enumerate(t["pieces"]):
            pw = f"{what} piece {i}"
            if not isinstance(p, dict):
                raise CheckpointError(f"{pw}: not an object")
            if p.get("file") not in meta["files"]:
                raise CheckpointError(f"{pw}: file {p.get('file')!r} is not listed under 'files'")
            if not isinstance(p.get("key"), str):
                raise CheckpointError(f"{pw}: 'key' must be a string")
            off = _ints(p.get("offset"), f"{pw} offset", len(shape))
            lsh = _ints(p.get("shape"), f"{pw} shape", len(shape))
            if any(o + s > g for o, s, g in zip(off, lsh, shape)):
                raise CheckpointError(f"{pw}: block at {off} of shape {lsh} lies outside the tensor's shape {shape}")
            fr = p.get("flat_range")
            if fr is not None:
                a, b = _ints(fr, f"{pw} flat_range", 2)
                if not a < b <= math.prod(lsh):
                    raise CheckpointError(f"{pw}: flat_range {fr} is outside its block's {math.prod(lsh)} elements")
                fr = (a, b)
            blocks.setdefault((tuple(off), tuple(lsh)), []).append(fr)
        total = 0
        for (off, lsh), ranges in blocks.items():
            n = math.prod(lsh)
            total += n
            if None in ranges:
                if len(ranges) > 1:
                    raise CheckpointError(f"{what}: block at {list(off)} is stored more than once (whole and/or in flat pieces)")
                continue
            pos = 0
            for a, b in sorted(ranges):  # type: ignore[type-var]
                if a != pos:
                    raise CheckpointError(f"{what}: flat pieces of block at {list(off)} leave a gap or overlap at element {pos}")
                pos = b
            if pos != n:
                raise CheckpointError(f"{what}: flat pieces of block at {list(off)} stop at element {pos} of {n}")
        if total != math.prod(shape):
            raise CheckpointError(
                f"{what}: its pieces hold {total} elements but shape {shape} has {math.prod(shape)} (missing or overlapping pieces)"
            )
