"""File-level helpers: a streaming safetensors writer, a header reader, checksums, fsync, safe paths.

The writer produces standard safetensors files (8-byte little-endian header length, JSON header,
raw little-endian data), readable by ``safetensors.safe_open``. It exists because the
``safetensors`` Python API serialises through an in-memory ``bytes`` copy of every tensor and does
not fsync; here each tensor's memory is written directly, checksummed in a second thread while
the next chunk is written, and fsync'ed.

Checksums are integrity checks against corruption (bit flips, truncation, torn or misplaced
writes), not authentication: the metadata that holds them is not signed. New files get a CRC-32
(``zlib.crc32`` of the whole file, as ``gzip``/zip compute it): about 1.5x less CPU per byte than
SHA-256 even with the CPU's SHA instructions, and it detects every burst of up to 32 bits. Files
recorded with SHA-256 (format version 1) are still verified with it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import queue
import re
import struct
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from mg_ckpt.errors import CheckpointError

DTYPE_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    # dtypes only some torch versions have
    **{getattr(torch, name): st
       for name, st in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"), ("uint32", "U32"),
                        ("uint64", "U64"))
       if hasattr(torch, name)},
}
ST_TO_DTYPE = {v: k for k, v in DTYPE_TO_ST.items()}

# Names of the files a checkpoint may reference: one path component, no leading dot.
_MEMBER_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
_CHUNK = 64 << 20
_FLUSH_EVERY = 256 << 20  # bytes written between two early fdatasync calls of the shard writer
_MAX_HEADER = 100 << 20


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (``"F32"``, ``"BF16"`` ...); ValueError if unsupported."""
    try:
        return DTYPE_TO_ST[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be stored in safetensors; convert the tensor first") from None


def torch_dtype(name: str, where: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name; CheckpointError naming ``where`` if unknown."""
    try:
        return ST_TO_DTYPE[name]
    except (KeyError, TypeError):
        raise CheckpointError(f"{where}: unknown dtype {name!r}") from None


def as_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (works for bf16/fp8, which numpy lacks)."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


CHECKSUM_ALGORITHMS = ("crc32", "sha256")
"""Checksum algorithms a reader verifies, by the key naming them in ``metadata.json``'s ``files`` entries."""
DEFAULT_CHECKSUM = "crc32"
"""The algorithm new shard files are recorded with."""


class FileHasher(Protocol):
    """What :func:`new_file_hasher` returns: a ``hashlib``-like incremental checksum."""

    name: str

    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc32:
    """``zlib.crc32`` behind the ``hashlib`` interface; digest as 8 lower-case hex digits."""

    name = "crc32"

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: bytes | memoryview, /) -> None:
        self._value = zlib.crc32(data, self._value)  # releases the GIL for large buffers

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def new_file_hasher(algorithm: str = DEFAULT_CHECKSUM) -> FileHasher:
    """A fresh incremental checksum of ``algorithm`` (one of :data:`CHECKSUM_ALGORITHMS`).

    Record a file written through it as ``{"size": n, hasher.name: hasher.hexdigest()}``.

    Raises:
        ValueError: an unknown algorithm.
    """
    if algorithm == "crc32":
        return _Crc32()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown checksum algorithm {algorithm!r}; use one of {CHECKSUM_ALGORITHMS}")


@dataclass(frozen=True)
class FileInfo:
    """Size in bytes and checksum (hex digest of ``algorithm``) of a written file."""

    size: int
    digest: str
    algorithm: str = "sha256"

    @property
    def sha256(self) -> str:
        """The digest when the algorithm is SHA-256 (AttributeError otherwise, never a mislabelled digest)."""
        if self.algorithm != "sha256":
            raise AttributeError(f"FileInfo holds a {self.algorithm} checksum, not SHA-256; use .entry()")
        return self.digest

    def entry(self) -> dict[str, int | str]:
        """The file's ``metadata.json`` entry: ``{"size": ..., <algorithm>: <digest>}``."""
        return {"size": self.size, self.algorithm: self.digest}


def build_header(items: Sequence[tuple[str, torch.Tensor]], metadata: dict[str, str] | None) -> bytes:
    """The padded safetensors header (length prefix included) for ``items`` in order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    pos = 0
    for name, t in items:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(
    path: str,
    items: Sequence[tuple[str, torch.Tensor]],
    metadata: dict[str, str] | None = None,
    *,
    checksum: str = DEFAULT_CHECKSUM,
) -> FileInfo:
    """Write ``items`` (name, contiguous CPU tensor) to ``path`` as safetensors, fsync it, return size + checksum.

    Names must be unique. The checksum (``checksum``: one of :data:`CHECKSUM_ALGORITHMS`) of the
    whole file runs in a helper thread on the chunks already written, so it overlaps the writing
    and the final fsync (both release the GIL); another thread starts flushing the written part to
    disk every 256 MiB, so the disk works while later chunks are written.

    Raises:
        ValueError: duplicate names, a non-CPU or non-contiguous tensor, an unsupported dtype or
            checksum algorithm.
        OSError: from the file system (disk full, permissions).
    """
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        raise ValueError(f"write_safetensors: duplicate tensor names in {path}")
    for name, t in items:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"write_safetensors: tensor {name!r} must be a contiguous CPU tensor")
    # Widest element first: with the 8-byte aligned header, every tensor's data is then aligned
    # to its element size (as the safetensors library lays files out), so readers can map it.
    items = sorted(items, key=lambda it: -it[1].element_size())
    head = build_header(items, metadata)
    digest = new_file_hasher(checksum)
    # Unbounded: the chunks are views of the caller's tensors (no copies), and letting the
    # checksum lag lets it finish during the fsync, when the disk, not the CPU, is busy.
    chunks: queue.Queue[memoryview | None] = queue.Queue()

    def hasher() -> None:
        while (c := chunks.get()) is not None:
            digest.update(c)

    worker = threading.Thread(target=hasher, name="mg-ckpt-hash", daemon=True)
    worker.start()
    size = 0
    try:
        with open(path, "wb", buffering=0) as f:
            with _EarlyFlush(f.fileno()) as flusher:
                for buf in [memoryview(head), *(as_bytes(t) for _, t in items)]:
                    for i in range(0, len(buf), _CHUNK):
                        c = buf[i : i + _CHUNK]
                        n = 0
                        while n < len(c):
                            n += f.write(c[n:])
                        chunks.put(c)
                        size += len(c)
                        flusher.written(size)
            os.fsync(f.fileno())
    finally:
        chunks.put(None)
        worker.join()
    return FileInfo(size, digest.hexdigest(), digest.name)


class _EarlyFlush:
    """Start writing a file's dirty pages to disk while later chunks are still being written.

    A helper thread calls ``fdatasync`` each time ``_FLUSH_EVERY`` more bytes were written, so the
    disk works during the writes (a ``memcpy`` into the page cache, CPU-bound) instead of only in
    the final ``fsync``. Its error, if any, is raised on exit: Linux reports a writeback error to
    one ``fsync`` of a file descriptor only, which may be this thread's.
    """

    def __init__(self, fd: int) -> None:
        self._fd, self._flushed, self._target = fd, 0, 0
        self._cond = threading.Condition()
        self._done = False
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._run, name="mg-ckpt-flush", daemon=True)

    def __enter__(self) -> _EarlyFlush:
        self._thread.start()
        return self

    def written(self, size: int) -> None:
        """Tell the flusher ``size`` bytes are written so far."""
        if size - self._flushed >= _FLUSH_EVERY:
            with self._cond:
                self._target = size
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._target <= self._flushed and not self._done:
                    self._cond.wait()
                if self._done:
                    return
                target = self._target
            try:
                os.fdatasync(self._fd)
            except OSError as e:
                self._error = e
                return
            self._flushed = target

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._done = True
            self._cond.notify()
        self._thread.join()
        if self._error is not None:
            raise self._error


def file_checksums(path: str, algorithms: Sequence[str]) -> dict[str, str]:
    """``{algorithm: hex digest}`` of a file for each of ``algorithms``, in one pass of 8 MiB reads.

    Raises:
        ValueError: an unknown algorithm.
        OSError: the file cannot be read.
    """
    hashers = [new_file_hasher(a) for a in algorithms]
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            for h in hashers:
                h.update(view[:n])
    return {a: h.hexdigest() for a, h in zip(algorithms, hashers)}


def file_sha256(path: str) -> str:
    """SHA-256 hex digest of a file, read in 8 MiB blocks (``sha256sum`` agrees)."""
    return file_checksums(path, ["sha256"])["sha256"]


def read_header(path: str) -> tuple[dict[str, dict], int]:
    """Parse and validate a safetensors header: ``({name: {dtype, shape, data_offsets}}, data_start)``.

    Raises:
        CheckpointError: the file is missing, truncated, or its header is malformed or points
            outside the file (naming the file).
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", raw_len)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{path}: corrupt safetensors header length {n} (file has {size} bytes)")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file is missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_start = 8 + n
    for name, e in header.items():
        try:
            dtype = torch_dtype(e["dtype"], f"{path} tensor {name!r}")
            shape = [int(s) for s in e["shape"]]
            b, end = (int(x) for x in e["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt header entry for tensor {name!r}") from None
        want = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if end - b != want or b < 0 or data_start + end > size:
            raise CheckpointError(
                f"{path}: tensor {name!r} data [{b}, {end}) does not fit its shape {shape} or the file "
                f"({size} bytes); the file is truncated or corrupt"
            )
    return header, data_start


def read_tensor(path: str, header: dict[str, dict], data_start: int, name: str) -> torch.Tensor:
    """Read one tensor of a safetensors file into fresh memory (no mmap: only that tensor becomes resident)."""
    e = header[name]
    dtype = torch_dtype(e["dtype"], f"{path} tensor {name!r}")
    out = torch.empty(e["shape"], dtype=dtype)
    b, end = e["data_offsets"]
    view = as_bytes(out)
    with open(path, "rb", buffering=0) as f:
        f.seek(data_start + b)
        got = 0
        while got < end - b:
            n = f.readinto(view[got:])
            if not n:
                raise CheckpointError(f"{path}: truncated while reading tensor {name!r}")
            got += n
    return out


def member_path(directory: str, name: object, what: str) -> str:
    """``directory/name`` after checking that ``name`` is a plain file name that stays inside ``directory``.

    Rejects absolute paths, separators, ``..``, hidden names and symlinks resolving outside.

    Raises:
        CheckpointError: naming ``what`` (e.g. the metadata file) and the offending name.
    """
    if not isinstance(name, str) or not _MEMBER_RE.fullmatch(name):
        raise CheckpointError(
            f"{what}: refusing file name {name!r} (must be a plain file name inside the checkpoint directory)"
        )
    path = os.path.join(directory, name)
    root = os.path.realpath(directory)
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise CheckpointError(f"{what}: file {name!r} resolves to {real}, outside the checkpoint directory {root}")
    return path


def fsync_dir(path: str) -> None:
    """fsync a directory so that renames/creations inside it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: str, text: str) -> None:
    """Replace ``path`` by a file holding ``text``: written to a temporary name, fsync'ed, renamed, dir fsync'ed."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
