"""Streaming checkpoint I/O: write logical tensors one at a time, read them back one at a time.

:func:`save_checkpoint` takes the whole state at once, which is what training has. Converting a
model from another format has it one tensor at a time and may not fit it in memory, so
:class:`StreamingCheckpointWriter` is told the names, shapes and dtypes up front (they fix every
shard file's safetensors header, so the header is written first) and then receives the tensors
in that order; each goes straight to its shard file, hashed as it is written. The result is an
ordinary version-1 checkpoint (one whole-tensor piece per tensor), committed with the same
protocol as :func:`save_checkpoint` (hidden temporary directory, fsync, rename, ``latest``), so
:func:`load_checkpoint` reads (and reshards) it and a crash leaves the previous checkpoint.

:class:`CheckpointReader` reads any checkpoint (any layout) one logical tensor at a time,
assembled from its pieces by :func:`load_checkpoint`, after verifying every file once.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from mg_ckpt import _commit, _io
from mg_ckpt import save as _save
from mg_ckpt.errors import CheckpointError
from mg_ckpt.load import load_checkpoint, verify_files
from mg_ckpt.metadata import (
    FORMAT_NAME,
    FORMAT_VERSION,
    METADATA_FILE,
    checkpoint_dir,
    read_metadata,
    resolve_checkpoint,
    temp_dir,
    validate_metadata,
    write_latest,
)

__all__ = ["CheckpointReader", "SafetensorsStreamWriter", "StreamingCheckpointWriter", "TensorSpec"]

TensorSpec = tuple[str, Sequence[int], torch.dtype]
"""``(name, shape, dtype)`` of a tensor to be written."""

# Test hook for crash injection: called with the name of each commit step.
_fault_hook: Callable[[str], None] | None = None
_CHUNK = 64 << 20


def _step(name: str) -> None:
    if _fault_hook is not None:
        _fault_hook(name)


def _checksum_algorithm() -> str:
    # The algorithm save_checkpoint records (read at each use, so the two writers always agree).
    return getattr(_save, "CHECKSUM", _io.DEFAULT_CHECKSUM)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class SafetensorsStreamWriter:
    """Write one safetensors file tensor by tensor: the header (from known shapes/dtypes) first, then each tensor's bytes.

    Tensors must be given in the order of ``specs``; the file is a standard safetensors file
    (readable by ``safetensors.safe_open``). Memory held: the tensor being written. The bytes are
    checksummed as they are written, with the algorithm :func:`save_checkpoint` records (or
    ``checksum``).

    Args:
        path: file to create (replaced if it exists).
        specs: ``(name, shape, dtype)`` of every tensor, in file order; names unique.
        metadata: string metadata for the header (``__metadata__``).
        checksum: checksum algorithm name (default: the one :func:`save_checkpoint` uses).

    Raises:
        ValueError: duplicate names or an unsupported dtype.
        OSError: from the file system.
    """

    def __init__(self, path: str, specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None,
                 checksum: str | None = None) -> None:
        names = [s[0] for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"SafetensorsStreamWriter: duplicate tensor names for {path}")
        header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
        pos = 0
        self._specs: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        for name, shape, dtype in specs:
            n = math.prod(shape) * _element_size(dtype)
            header[name] = {"dtype": _io.dtype_name(dtype), "shape": list(shape), "data_offsets": [pos, pos + n]}
            self._specs.append((name, tuple(int(s) for s in shape), dtype))
            pos += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data then starts 8-byte aligned, as the safetensors library writes it
        self.path = path
        self._next = 0
        self._digest = _io.new_file_hasher(checksum or _checksum_algorithm())
        self._size = 0
        self._file = open(path, "wb")  # noqa: SIM115 - closed by close()/abort()
        self._write(memoryview(struct.pack("<Q", len(raw)) + raw))

    @property
    def next_name(self) -> str | None:
        """The tensor :meth:`write` expects next (None when all are written)."""
        return self._specs[self._next][0] if self._next < len(self._specs) else None

    def _write(self, buf: memoryview) -> None:
        for i in range(0, len(buf), _CHUNK):
            c = buf[i : i + _CHUNK]
            self._file.write(c)
            self._digest.update(c)
            self._size += len(c)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor`` (any device/layout; exact shape and dtype of its spec) as the next tensor.

        Raises:
            ValueError: ``name`` is not the next tensor of the specs, or shape/dtype differ.
        """
        if self._next >= len(self._specs):
            raise ValueError(f"{self.path}: tensor {name!r} given after all {len(self._specs)} tensors were written")
        want, shape, dtype = self._specs[self._next]
        if name != want:
            raise ValueError(f"{self.path}: expected tensor {want!r} next (order of the specs), got {name!r}")
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"{self.path}: tensor {name!r} is {tensor.dtype}{list(tensor.shape)} but was declared "
                             f"{dtype}{list(shape)}")
        t = tensor.detach().to(torch.device("cpu")).contiguous()
        self._write(_io.as_bytes(t))
        self._next += 1

    def close(self) -> _io.FileInfo:
        """fsync and close the file; return its size and checksum (``.entry()`` is its metadata.json entry).

        Raises:
            ValueError: not every declared tensor was written.
        """
        if self._next != len(self._specs):
            missing = [s[0] for s in self._specs[self._next :]]
            self.abort()
            raise ValueError(f"{self.path}: closed before tensors {missing[:5]} were written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return _io.FileInfo(self._size, self._digest.hexdigest(), self._digest.name)

    def abort(self) -> None:
        """Close and delete the partial file."""
        if not self._file.closed:
            self._file.close()
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass


def plan_files(specs: Sequence[TensorSpec], max_file_bytes: int) -> list[list[TensorSpec]]:
    """Split ``specs`` (in order) into files of at most ``max_file_bytes`` (a larger tensor gets a file of its own).

    A file also ends where the next tensor would not start at a multiple of its element size,
    so every tensor stays aligned for readers that map the file.

    Raises:
        ValueError: ``max_file_bytes < 1``.
    """
    if max_file_bytes < 1:
        raise ValueError(f"max_file_bytes must be >= 1, got {max_file_bytes}")
    files: list[list[TensorSpec]] = []
    pos = 0
    for spec in specs:
        size = _element_size(spec[2])
        n = math.prod(spec[1]) * size
        if not files or (files[-1] and (pos + n > max_file_bytes or pos % size)):
            files.append([])
            pos = 0
        files[-1].append(spec)
        pos += n
    return files


class StreamingCheckpointWriter:
    """Write an mg checkpoint ``save_dir/iter_{N:07d}`` one logical tensor at a time (one process, no collectives).

    Declare every tensor up front (``specs``), then call :meth:`write` for each in that order and
    :meth:`commit`. Shard files ``stream_00000.safetensors``, ... of at most ``max_shard_bytes``
    are written into ``save_dir/.tmp_iter_N``; :meth:`commit` writes ``metadata.json`` (each file's
    size and checksum, with the algorithm and entry format :func:`save_checkpoint` uses), renames the directory into place
    and updates ``latest``. Used as a context manager, an exception aborts (removes the temporary
    directory) and a normal exit commits.

    Args:
        save_dir: root directory for ``iter_*`` checkpoints and ``latest``.
        iteration: the iteration number to save as.
        specs: ``(name, global shape, dtype)`` of each tensor, in writing order.
        extra: JSON-able state returned by :func:`load_checkpoint`.
        layout: JSON-able description recorded as ``layout``.
        max_shard_bytes: shard file size bound in bytes.

    Raises:
        ValueError: negative iteration, duplicate names, non-JSON ``extra``/``layout``, bad ``max_shard_bytes``.
        CheckpointError: ``save_dir`` cannot be prepared.
    """

    def __init__(self, save_dir: str, iteration: int, specs: Iterable[TensorSpec], *,
                 extra: Mapping[str, Any] | None = None, layout: Mapping[str, Any] | None = None,
                 max_shard_bytes: int = 2 << 30) -> None:
        if not isinstance(iteration, int) or iteration < 0:
            raise ValueError(f"StreamingCheckpointWriter: iteration must be a non-negative int, got {iteration!r}")
        specs = [(n, tuple(int(s) for s in shape), dtype) for n, shape, dtype in specs]
        if len({s[0] for s in specs}) != len(specs):
            raise ValueError("StreamingCheckpointWriter: tensor names must be unique")
        try:
            self._extra = json.loads(json.dumps(dict(extra or {}), allow_nan=False))
            self._layout = json.loads(json.dumps(dict(layout or {}), allow_nan=False))
        except (TypeError, ValueError) as e:
            raise ValueError(f"StreamingCheckpointWriter: extra/layout must be JSON-serialisable: {e}") from e
        self.save_dir, self.iteration = save_dir, iteration
        self.path = checkpoint_dir(save_dir, iteration)
        """Final directory of the checkpoint."""
        self._tmp = temp_dir(save_dir, iteration)
        self._files = plan_files(specs, max_shard_bytes)
        self._tensors: dict[str, Any] = {}
        for i, group in enumerate(self._files):
            for name, shape, dtype in group:
                self._tensors[name] = {"shape": list(shape), "dtype": _io.dtype_name(dtype), "pieces": [{
                    "file": self._file_name(i), "key": name, "offset": [0] * len(shape), "shape": list(shape),
                    "flat_range": None}]}
        self._infos: dict[str, dict[str, Any]] = {}
        self._file_index = -1
        self._writer: SafetensorsStreamWriter | None = None
        self._remaining: list[str] = []
        self._done = False
        try:
            os.makedirs(save_dir, exist_ok=True)
            _commit.clean_stale(save_dir)
            os.makedirs(self._tmp)
        except OSError as e:
            raise CheckpointError(f"saving {self.path}: cannot create {self._tmp}: {e}") from None

    @staticmethod
    def _file_name(i: int) -> str:
        return f"stream_{i:05d}.safetensors"

    def _open_next(self) -> None:
        if self._writer is not None:
            info = self._writer.close()
            self._infos[os.path.basename(self._writer.path)] = info.entry()
            self._writer = None
        self._file_index += 1
        if self._file_index < len(self._files):
            specs = self._files[self._file_index]
            self._writer = SafetensorsStreamWriter(os.path.join(self._tmp, self._file_name(self._file_index)), specs)
            self._remaining = [s[0] for s in specs]

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next declared tensor (exact declared shape and dtype; any device).

        Raises:
            ValueError: out of order, undeclared, or of another shape/dtype than declared.
            OSError: from the file system.
        """
        if self._done:
            raise ValueError(f"StreamingCheckpointWriter({self.path}): already committed or aborted")
        if not self._remaining:
            self._open_next()
            if self._writer is None:
                raise ValueError(f"{self.path}: tensor {name!r} given after every declared tensor was written")
        assert self._writer is not None
        self._writer.write(name, tensor)
        self._remaining.pop(0)

    def commit(self) -> str:
        """Finish the last file, write ``metadata.json``, rename into place, update ``latest``; return the path.

        Raises:
            ValueError: declared tensors were not written.
            CheckpointError: the commit failed (the previous checkpoint stays the latest).
        """
        if self._done:
            raise ValueError(f"StreamingCheckpointWriter({self.path}): already committed or aborted")
        if self._remaining or self._file_index + 1 < len(self._files):
            missing = self._remaining + [s[0] for f in self._files[self._file_index + 1 :] for s in f]
            self.abort()
            raise ValueError(f"{self.path}: commit before tensors {missing[:5]} were written")
        self._open_next()  # closes (fsyncs) the last file
        meta = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "iteration": self.iteration, "world_size": 1,
                "layout": self._layout, "state": self._extra, "files": self._infos, "tensors": self._tensors}
        try:
            validate_metadata(meta, self._tmp)
            with open(os.path.join(self._tmp, METADATA_FILE), "w") as f:
                json.dump(meta, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            _io.fsync_dir(self._tmp)
            _step("before_rename")
            _commit.commit(self.save_dir, self._tmp, self.path)
            _step("after_rename")
            write_latest(self.save_dir, self.iteration)
        except OSError as e:
            raise CheckpointError(f"saving checkpoint {self.path}: commit failed: {e!r}") from None
        self._done = True
        return self.path

    def abort(self) -> None:
        """Discard everything written (removes the temporary directory); the previous checkpoint is untouched."""
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
        self._done = True
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> StreamingCheckpointWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is not None:
            if not self._done:
                self.abort()
        elif not self._done:
            self.commit()


class CheckpointReader:
    """Read an mg checkpoint (saved at any layout) one logical tensor at a time.

    Each :meth:`read` assembles whole global tensors from their pieces with
    :func:`load_checkpoint` (positioned reads into fresh memory), so memory holds only the
    tensors asked for. With ``verify`` every shard file's size and checksum are checked once, up
    front (sequential reads, constant memory). :meth:`read` is :func:`load_checkpoint`, hence
    collective when ``torch.distributed`` is initialised: use it in one process, or on every rank.

    Args:
        path: a checkpoint directory or a save directory (its latest checkpoint).
        verify: check the files' checksums before reading.

    Raises:
        CheckpointError: no checkpoint, invalid metadata, a corrupted/missing/truncated file.
    """

    def __init__(self, path: str, *, verify: bool = True) -> None:
        self.path = resolve_checkpoint(path)
        """The resolved ``iter_N`` directory."""
        meta = read_metadata(self.path)
        if verify:
            verify_files(self.path, meta)
        self.iteration: int = meta["iteration"]
        """The checkpoint's iteration."""
        self.extra: dict[str, Any] = dict(meta["state"])
        """The training state saved with it (``extra`` of the save)."""
        self.layout: dict[str, Any] = dict(meta["layout"])
        """The layout it was saved from."""
        self.specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            name: (tuple(t["shape"]), _io.torch_dtype(t["dtype"], f"{self.path} tensor {name!r}"))
            for name, t in meta["tensors"].items()
        }
        """``{name: (global shape, dtype)}`` of every logical tensor."""

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The whole global tensors ``names`` (CPU, stored dtype).

        Raises:
            CheckpointError: a name not in the checkpoint, or unreadable pieces.
        """
        names = list(names)
        absent = [n for n in names if n not in self.specs]
        if absent:
            raise CheckpointError(f"{self.path}: tensors {absent[:5]} are not in the checkpoint")
        template = {n: torch.empty(self.specs[n][0], dtype=self.specs[n][1]) for n in names}
        load_checkpoint(self.path, template, verify=False)
        return template

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for every logical tensor, one in memory at a time."""
        for name in self.specs:
            yield name, self.read([name])[name]
