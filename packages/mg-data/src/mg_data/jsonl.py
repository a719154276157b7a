"""JSONL input: file expansion, (de)compression, line-aligned chunking, and per-line parsing."""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
from collections.abc import Iterator, Sequence
from typing import IO, Any


class BadLineError(ValueError):
    """A JSONL line is malformed, lacks a key, holds a non-string value or is not UTF-8.

    Attributes:
        path: the input file; line: its 1-based line number (None when unknown); reason: what is wrong.
    """

    hint = " (fix the line, or pass --skip-bad-lines to skip and count it)"
    """Appended to the message; subclasses raised where no line can be skipped set it to ``""``."""

    def __init__(self, path: str, line: int | None, reason: str) -> None:
        self.path, self.line, self.reason = path, line, reason
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {reason}{self.hint}")


def expand_inputs(inputs: Sequence[str | os.PathLike[str]]) -> list[str]:
    """Files named by ``inputs`` (paths or globs), in the order given, globs sorted.

    Raises:
        FileNotFoundError: an input matches no file.
    """
    out: list[str] = []
    for item in inputs:
        item = os.fspath(item)
        if any(c in item for c in "*?["):
            found = sorted(glob.glob(item, recursive=True))
            if not found:
                raise FileNotFoundError(f"{item}: glob matches no file")
            out.extend(found)
        elif os.path.isfile(item):
            out.append(item)
        else:
            raise FileNotFoundError(f"{item}: input file not found")
    return out


def is_compressed(path: str) -> bool:
    """Whether ``path`` is gzip or zstd compressed (by extension)."""
    return path.endswith((".gz", ".zst", ".zstd"))


def open_binary(path: str) -> IO[bytes]:
    """Open ``path`` for reading bytes, decompressing ``.gz``/``.zst`` on the fly.

    Raises:
        ImportError: a ``.zst`` file without the ``zstd`` extra installed.
    """
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith((".zst", ".zstd")):
        try:
            import zstandard
        except ImportError:
            raise ImportError(f"{path}: reading .zst needs `pip install mg-data[zstd]`") from None
        fh = open(path, "rb")  # noqa: SIM115 - owned by the returned reader
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(fh, closefd=True))
    return open(path, "rb")


def load_json_line(raw: bytes | str, path: str, line: int | None, error: type[BadLineError] = BadLineError) -> Any:
    """The parsed JSON value of one line.

    Raises:
        error (a BadLineError): invalid UTF-8 or malformed JSON.
    """
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as e:
        raise error(path, line, f"invalid UTF-8 at byte {e.start}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(path, line, f"malformed JSON ({e.msg} at column {e.colno})") from None


def parse_line(raw: bytes, keys: Sequence[str], path: str, line: int | None) -> list[str]:
    """The string values of ``keys`` in one JSONL line.

    Raises:
        BadLineError: invalid UTF-8, malformed JSON, not an object, a missing key or a non-string value.
    """
    return values_of(load_json_line(raw, path, line), keys, path, line)


def values_of(obj: Any, keys: Sequence[str], path: str, line: int | None,
              error: type[BadLineError] = BadLineError) -> list[str]:
    """``[obj[k] for k in keys]``, checking that ``obj`` is an object with string values.

    Raises:
        error (a BadLineError): as ``parse_line``.
    """
    if not isinstance(obj, dict):
        raise error(path, line, f"expected a JSON object, got {type(obj).__name__}")
    out = []
    for k in keys:
        if k not in obj:
            raise error(path, line, f"missing key {k!r}")
        v = obj[k]
        if not isinstance(v, str):
            raise error(path, line, f"key {k!r} holds {type(v).__name__}, expected a string")
        out.append(v)
    return out


def iter_json_texts(inputs: Sequence[str | os.PathLike[str]], keys: Sequence[str]) -> Iterator[str]:
    """Every ``keys`` value of every line of ``inputs`` (bad and blank lines are skipped)."""
    for path in expand_inputs(inputs):
        with open_binary(path) as f:
            for n, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    yield from parse_line(raw, keys, path, n)
                except BadLineError:
                    continue


def byte_range_chunks(path: str, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """Line-aligned ``(start, end)`` byte ranges of an uncompressed file.

    A chunk ends with the line holding its ``chunk_bytes``-th byte, so the cut points depend on
    the file alone (never on the number of workers) and match ``stream_chunks``.
    """
    size = os.path.getsize(path)
    start = 0
    with open(path, "rb") as f:
        while start < size:
            f.seek(min(start + chunk_bytes - 1, size))
            f.readline()
            end = min(f.tell(), size)
            yield start, end
            start = end


def stream_chunks(f: IO[bytes], chunk_bytes: int) -> Iterator[bytes]:
    """Line-aligned chunks of a stream, cut exactly where ``byte_range_chunks`` would cut."""
    buf = bytearray()
    while True:
        block = f.read(max(chunk_bytes, 1 << 16))
        if not block:
            break
        buf += block
        while len(buf) >= chunk_bytes:
            nl = buf.find(b"\n", chunk_bytes - 1)
            if nl < 0:
                break
            yield bytes(buf[: nl + 1])
            del buf[: nl + 1]
    if buf:
        yield bytes(buf)


def count_lines_before(path: str, offset: int) -> int:
    """Number of newlines in the first ``offset`` bytes of ``path`` (decompressed)."""
    n = 0
    left = offset
    with open_binary(path) as f:
        while left > 0:
            block = f.read(min(left, 1 << 24))
            if not block:
                break
            n += block.count(b"\n")
            left -= len(block)
    return n
