"""Streaming Hugging Face style safetensors directories (``model-0000i-of-0000n.safetensors`` + index).

Converting a large model must not need the whole model in memory. The writer consumes an
iterator of ``(name, tensor)`` and keeps at most one shard's worth of tensors (plus the tensor
being added) in memory; the reader yields one tensor at a time, reading it with ``readinto`` into
fresh memory (no memory map, so only that tensor becomes resident). Given the tensors' names,
shapes and dtypes up front (``specs``), the writer instead plans the shards first and streams
each tensor straight to its file, holding only that tensor.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence

import torch

from mg_ckpt._io import (
    member_path,
    read_header,
    read_tensor,
    torch_dtype,
    write_safetensors,
    write_text_atomic,
)
from mg_ckpt.errors import CheckpointError

__all__ = ["INDEX_FILE", "HFSafetensorsReader", "iter_hf_safetensors", "read_hf_index", "write_hf_safetensors"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def write_hf_safetensors(
    out_dir: str,
    tensors: Iterable[tuple[str, torch.Tensor]],
    max_shard_bytes: int = 5 * 2**30,
    *,
    metadata: dict[str, str] | None = None,
    specs: Sequence[tuple[str, Sequence[int], torch.dtype]] | None = None,
) -> dict:
    """Write ``tensors`` as ``out_dir/model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``.

    Tensors are taken from the iterator in order and packed into shards of at most
    ``max_shard_bytes`` (a single larger tensor gets a shard of its own). Each shard is written
    and fsync'ed as soon as it is full, so peak memory is about one shard plus one tensor. Shard
    names are given once their count is known; earlier ``model-*-of-*.safetensors`` files and index
    in ``out_dir`` are replaced.

    Args:
        out_dir: directory to write (created if needed).
        tensors: ``(name, tensor)`` pairs, names unique; tensors on any device.
        max_shard_bytes: shard size bound in bytes.
        metadata: string metadata for every shard header (default ``{"format": "pt"}``).
        specs: ``(name, shape, dtype)`` of every tensor, in the iterator's order. When given, the
            shards are planned from them and each tensor is written to disk as it arrives (peak
            memory: one tensor); the iterator must then yield exactly these tensors in this order.

    Returns:
        The index written: ``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``.

    Raises:
        ValueError: duplicate names or ``max_shard_bytes < 1``; with ``specs``, a tensor out of
            order, of another shape/dtype than declared, or missing.
    """
    if max_shard_bytes < 1:
        raise ValueError(f"write_hf_safetensors: max_shard_bytes must be >= 1, got {max_shard_bytes}")
    os.makedirs(out_dir, exist_ok=True)
    meta = {"format": "pt"} if metadata is None else dict(metadata)
    if specs is not None:
        return _write_planned(out_dir, tensors, max_shard_bytes, meta, specs)
    shard_of: dict[str, int] = {}
    buffer: list[tuple[str, torch.Tensor]] = []
    buffered = total = 0
    count = 0

    def flush() -> None:
        nonlocal buffered, count
        if buffer:
            write_safetensors(os.path.join(out_dir, f".partial-{count:05d}.safetensors"), buffer, meta)
            count += 1
            buffer.clear()
            buffered = 0

    for name, t in tensors:
        if name in shard_of:
            raise ValueError(f"write_hf_safetensors: tensor name {name!r} appears twice")
        t = t.detach().to(torch.device("cpu")).contiguous()
        n = t.numel() * t.element_size()
        if buffered and buffered + n > max_shard_bytes:
            flush()
        buffer.append((name, t))
        del t  # the buffer holds the only reference we keep
        buffered += n
        total += n
        shard_of[name] = count
    flush()

    return _publish(out_dir, count, shard_of, total)


def _publish(out_dir: str, count: int, shard_of: dict[str, int], total: int) -> dict:
    """Rename ``.partial-i`` shards to their final names (replacing older shards) and write the index."""
    for fname in os.listdir(out_dir):
        if _SHARD_RE.fullmatch(fname) or fname in (INDEX_FILE, SINGLE_FILE):
            os.remove(os.path.join(out_dir, fname))
    names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    for i, final in enumerate(names):
        os.replace(os.path.join(out_dir, f".partial-{i:05d}.safetensors"), os.path.join(out_dir, final))
    index = {"metadata": {"total_size": total}, "weight_map": {k: names[i] for k, i in shard_of.items()}}
    write_text_atomic(os.path.join(out_dir, INDEX_FILE), json.dumps(index, indent=2) + "\n")
    return index


def _write_planned(out_dir: str, tensors: Iterable[tuple[str, torch.Tensor]], max_shard_bytes: int,
                   meta: dict[str, str], specs: Sequence[tuple[str, Sequence[int], torch.dtype]]) -> dict:
    from mg_ckpt.stream import SafetensorsStreamWriter, plan_files

    specs = [(n, tuple(int(s) for s in shape), dtype) for n, shape, dtype in specs]
    if len({s[0] for s in specs}) != len(specs):
        raise ValueError("write_hf_safetensors: tensor names in specs must be unique")
    plan = plan_files(specs, max_shard_bytes)
    shard_of = {name: i for i, group in enumerate(plan) for name, _, _ in group}
    it = iter(tensors)
    total = 0
    partial = [os.path.join(out_dir, f".partial-{i:05d}.safetensors") for i in range(len(plan))]
    try:
        for path, group in zip(partial, plan):
            writer = SafetensorsStreamWriter(path, group, meta)
            for _ in group:
                try:
                    name, t = next(it)
                except StopIteration:
                    raise ValueError(f"write_hf_safetensors: the iterator ended before tensor {writer.next_name!r}") from None
                writer.write(name, t)
                total += t.numel() * t.element_size()
                del t
            writer.close()
        leftover = next(it, None)
        if leftover is not None:
            raise ValueError(f"write_hf_safetensors: tensor {leftover[0]!r} was not declared in specs")
    except BaseException:
        for path in partial:  # leave the directory as it was
            if os.path.exists(path):
                os.remove(path)
        raise
    return _publish(out_dir, len(plan), shard_of, total)


def read_hf_index(directory: str) -> dict[str, str]:
    """``{tensor name: file name}`` of a Hugging Face safetensors directory (index or single ``model.safetensors``).

    Raises:
        CheckpointError: no safetensors weights in ``directory``, a malformed index, or an index
            naming a file outside the directory.
    """
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: malformed index ({e!r})") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path}: 'weight_map' must map tensor names to file names")
        for fname in set(weight_map.values()):
            member_path(directory, fname, index_path)
        return dict(weight_map)
    single = os.path.join(directory, SINGLE_FILE)
    if os.path.isfile(single):
        header, _ = read_header(single)
        return {name: SINGLE_FILE for name in header}
    raise CheckpointError(f"{directory}: no {INDEX_FILE} or {SINGLE_FILE} found")


def iter_hf_safetensors(directory: str, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, CPU tensor)`` from a Hugging Face safetensors directory, one tensor in memory at a time.

    Files are visited in name order and tensors in file order (sequential reads). ``names``
    restricts the output to those tensors.

    Raises:
        CheckpointError: as :func:`read_hf_index`; a named tensor absent from the directory; a
            file missing, truncated or not holding a tensor its index promises.
    """
    weight_map = read_hf_index(directory)
    wanted = set(weight_map) if names is None else set(names)
    absent = sorted(wanted - set(weight_map))
    if absent:
        raise CheckpointError(f"{directory}: tensors {absent[:8]} are not in the weight map")
    by_file: dict[str, list[str]] = {}
    for name in wanted:
        by_file.setdefault(weight_map[name], []).append(name)
    for fname in sorted(by_file):
        path = member_path(directory, fname, directory)
        header, data_start = read_header(path)
        lost = [n for n in by_file[fname] if n not in header]
        if lost:
            raise CheckpointError(f"{path}: tensors {lost[:8]} listed in the index are not in the file")
        for name in sorted(by_file[fname], key=lambda n: header[n]["data_offsets"][0]):
            yield name, read_tensor(path, header, data_start, name)


class HFSafetensorsReader:
    """Random access to the tensors of a Hugging Face safetensors directory, one read at a time.

    Headers are parsed once per file; :meth:`read` reads a tensor into fresh memory (no map), so
    only the tensors asked for become resident.

    Args:
        directory: the model directory (index + shards, or a single ``model.safetensors``).

    Raises:
        CheckpointError: as :func:`read_hf_index`, or a shard whose header is corrupt.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.weight_map = read_hf_index(directory)
        """``{tensor name: file name}``."""
        self._headers: dict[str, tuple[str, dict[str, dict], int]] = {}

    def _header(self, name: str) -> tuple[str, dict[str, dict], int]:
        if name not in self.weight_map:
            raise CheckpointError(f"{self.directory}: tensor {name!r} is not in the weight map")
        fname = self.weight_map[name]
        if fname not in self._headers:
            path = member_path(self.directory, fname, self.directory)
            header, data_start = read_header(path)
            self._headers[fname] = (path, header, data_start)
        path, header, _ = self._headers[fname]
        if name not in header:
            raise CheckpointError(f"{path}: tensor {name!r} listed in the index is not in the file")
        return self._headers[fname]

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """``(shape, dtype)`` of tensor ``name`` from its file's header (no data read).

        Raises:
            CheckpointError: unknown name, or a file missing/corrupt.
        """
        path, header, _ = self._header(name)
        return tuple(header[name]["shape"]), torch_dtype(header[name]["dtype"], f"{path} tensor {name!r}")

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as a fresh CPU tensor.

        Raises:
            CheckpointError: unknown name, or a file missing/truncated/corrupt.
        """
        path, header, data_start = self._header(name)
        return read_tensor(path, header, data_start, name)
