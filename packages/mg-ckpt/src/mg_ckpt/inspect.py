"""Describe a checkpoint without loading it: layout, iteration, tensors, files, checksum status."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from mg_ckpt._io import read_header, torch_dtype
from mg_ckpt.errors import CheckpointError
from mg_ckpt.load import verify_files
from mg_ckpt.metadata import file_digests, read_metadata, resolve_checkpoint

__all__ = ["CheckpointReport", "FileReport", "TensorReport", "inspect_checkpoint"]


@dataclass(frozen=True)
class TensorReport:
    """One logical tensor: global shape, dtype, bytes, number of stored pieces."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    num_pieces: int


@dataclass(frozen=True)
class FileReport:
    """One shard file: size in bytes, recorded checksum (``algorithm``, hex ``digest``), tensors stored."""

    name: str
    size: int
    algorithm: str
    digest: str
    num_tensors: int


@dataclass(frozen=True)
class CheckpointReport:
    """What :func:`inspect_checkpoint` found (``verified`` tells whether checksums were checked)."""

    path: str
    iteration: int
    format_version: int
    world_size: int
    layout: dict[str, Any]
    state: dict[str, Any]
    tensors: list[TensorReport] = field(default_factory=list)
    files: list[FileReport] = field(default_factory=list)
    verified: bool = False

    @property
    def total_bytes(self) -> int:
        """Sum of the shard files' sizes."""
        return sum(f.size for f in self.files)

    def format(self, max_tensors: int | None = 50) -> str:
        """A human-readable multi-line summary (the first ``max_tensors`` tensors listed)."""
        lines = [
            f"checkpoint {self.path}",
            f"  iteration {self.iteration}, format v{self.format_version}, saved by {self.world_size} ranks",
            f"  layout {self.layout}",
            f"  {len(self.files)} files, {self.total_bytes / 2**20:.1f} MiB, "
            + f"{'/'.join(sorted({f.algorithm for f in self.files})) or 'no'} checksums "
            + ("verified" if self.verified else "not checked"),
            f"  state keys: {sorted(self.state)}",
            f"  {len(self.tensors)} tensors:",
        ]
        shown = self.tensors if max_tensors is None else self.tensors[:max_tensors]
        for t in shown:
            lines.append(f"    {t.name}  {t.dtype}{list(t.shape)}  {t.nbytes / 2**20:.2f} MiB  ({t.num_pieces} pieces)")
        if len(shown) < len(self.tensors):
            lines.append(f"    ... {len(self.tensors) - len(shown)} more")
        return "\n".join(lines)


def inspect_checkpoint(path: str, *, verify: bool = True) -> CheckpointReport:
    """Read a checkpoint's metadata and shard headers and, with ``verify``, check every file's checksum.

    Single-process (no collectives). ``path`` is a checkpoint or a save directory (then its latest).

    Raises:
        CheckpointError: invalid metadata, a missing/truncated/corrupted shard file (naming it),
            or a shard header disagreeing with the metadata.
    """
    ckpt = resolve_checkpoint(path)
    meta = read_metadata(ckpt)
    if verify:
        verify_files(ckpt, meta)
    files = []
    for fname, info in sorted(meta["files"].items()):
        header, _ = read_header(f"{ckpt}/{fname}")
        algorithm, digest = next(iter(file_digests(info).items()))
        files.append(FileReport(fname, info["size"], algorithm, digest, len(header)))
        for name, t in meta["tensors"].items():
            for p in t["pieces"]:
                if p["file"] == fname and p["key"] not in header:
                    raise CheckpointError(f"{ckpt}/{fname}: tensor {p['key']!r} (for {name!r}) is not in the file")
    tensors = []
    for name, t in meta["tensors"].items():
        size = torch_dtype(t["dtype"], name).itemsize
        tensors.append(TensorReport(name, tuple(t["shape"]), t["dtype"], math.prod(t["shape"]) * size, len(t["pieces"])))
    return CheckpointReport(
        path=ckpt,
        iteration=meta["iteration"],
        format_version=meta["version"],
        world_size=int(meta.get("world_size", 0)),
        layout=meta["layout"],
        state=meta["state"],
        tensors=tensors,
        files=files,
        verified=verify,
    )
