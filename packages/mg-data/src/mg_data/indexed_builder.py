"""Streaming writer of Megatron ``MMIDIDX`` ``.bin``/``.idx`` pairs (format in ``mg_data.indexed``)."""

from __future__ import annotations

import os
import struct
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mg_data.indexed import MAGIC, VERSION, IndexedDataset, data_file_path, dtype_code, index_file_path


class _SpillArray:
    """Append-only integer array that spills to a file so builders keep O(1) memory."""

    def __init__(self, path: str, typecode: str, limit: int = 1 << 20) -> None:
        self.path, self.typecode, self.limit = path, typecode, limit
        self.buf = array(typecode)
        self.count = 0
        self.file: Any = None  # opened on the first spill: small datasets never touch the disk

    def append(self, value: int) -> None:
        self.buf.append(value)
        if len(self.buf) >= self.limit:
            self.flush()

    def extend(self, values: np.ndarray) -> None:
        if len(self.buf) + len(values) < self.limit:
            self.buf.frombytes(np.ascontiguousarray(values, dtype=self.typecode).tobytes())
            return
        self.flush()
        np.ascontiguousarray(values, dtype=np.dtype(self.typecode).newbyteorder("<")).tofile(self._open())
        self.count += len(values)

    def _open(self) -> Any:
        if self.file is None:
            self.file = open(self.path, "wb")  # noqa: SIM115 - closed in chunks()/discard()
        return self.file

    def flush(self) -> None:
        if self.buf:
            np.frombuffer(self.buf, dtype=self.typecode).astype("<" + self.typecode).tofile(self._open())
            self.count += len(self.buf)
            self.buf = array(self.typecode)

    def total(self) -> int:
        return self.count + len(self.buf)

    def chunks(self, size: int = 1 << 22):
        if self.file is None:  # everything is still in memory
            arr = np.frombuffer(self.buf, dtype=self.typecode)
            for s in range(0, len(arr), size):
                yield arr[s:s + size]
            return
        self.flush()
        self.file.close()
        arr = np.memmap(self.path, dtype="<" + self.typecode, mode="r")
        for s in range(0, self.count, size):
            yield np.asarray(arr[s:s + size])

    def discard(self) -> None:
        if self.file is not None:
            self.file.close()
            if os.path.exists(self.path):
                os.remove(self.path)


class IndexedDatasetBuilder:
    """Streaming writer of a ``PREFIX.bin``/``PREFIX.idx`` pair.

    Tokens go straight to a temporary ``.bin``; lengths spill to temporary files, so memory
    stays bounded whatever the corpus size. Nothing appears under the final names until
    ``finalize()``, which writes the ``.idx`` and renames both files (``.bin`` first), so a crash
    never leaves a valid-looking half dataset. Use as a context manager to clean up on error.

    Args:
        prefix: output prefix (``PREFIX.bin``/``PREFIX.idx``).
        dtype: token dtype; see ``optimal_dtype(vocab_size)``.
        durable: fsync both files before renaming them (survives power loss, costs time).
    """

    def __init__(self, prefix: str | os.PathLike[str], dtype: type[np.generic] | np.dtype[Any] = np.int32,
                 durable: bool = True):
        self.prefix = os.fspath(prefix)
        self.durable = durable
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        tag = f".tmp-{os.getpid()}-{id(self):x}"
        self._bin_tmp = data_file_path(self.prefix) + tag
        self._idx_tmp = index_file_path(self.prefix) + tag
        self._bin = open(self._bin_tmp, "wb")  # noqa: SIM115 - closed in finalize()/abort()
        self._sizes = _SpillArray(self._idx_tmp + ".sizes", "i")
        self._docs = _SpillArray(self._idx_tmp + ".docs", "q")
        self._docs.append(0)
        self._done = False

    def add_item(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one sequence (tokens are cast to the builder dtype; out-of-range values raise)."""
        arr = np.asarray(tokens)
        if arr.dtype != self.dtype:
            if arr.size and np.issubdtype(self.dtype, np.integer):
                info = np.iinfo(self.dtype)
                if arr.min() < info.min or arr.max() > info.max:
                    raise ValueError(f"{self.prefix}: token ids {arr.min()}..{arr.max()} do not fit "
                                     f"{self.dtype}; build with a wider dtype")
            arr = arr.astype(self.dtype)
        self._bin.write(arr.astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
        self._sizes.append(arr.shape[0])

    def end_document(self) -> None:
        """Mark the sequences added since the previous call as one document."""
        self._docs.append(self._sizes.total())

    def add_document(self, tokens: Sequence[int] | np.ndarray, sentence_lengths: Sequence[int] | None = None
                     ) -> None:
        """Append a document: ``tokens`` cut into sequences of ``sentence_lengths`` (one if None)."""
        arr = np.asarray(tokens)
        if sentence_lengths is None:
            self.add_item(arr)
        else:
            if int(np.sum(sentence_lengths)) != arr.shape[0]:
                raise ValueError(f"{self.prefix}: sentence_lengths sum to {int(np.sum(sentence_lengths))} "
                                 f"but the document has {arr.shape[0]} tokens")
            start = 0
            for n in sentence_lengths:
                self.add_item(arr[start:start + n])
                start += n
        self.end_document()

    def add_batch(self, flat_tokens: np.ndarray, lengths: np.ndarray, doc_ends: np.ndarray | None = None
                  ) -> None:
        """Append many sequences at once (the fast path used by preprocessing).

        Args:
            flat_tokens: all tokens, already of the builder dtype, shape (sum(lengths),).
            lengths: tokens per sequence, shape (n,).
            doc_ends: for each document, the number of sequences of this batch before its end
                (shape (docs,)); None means every sequence is a document.
        """
        flat = np.ascontiguousarray(flat_tokens, dtype=self.dtype.newbyteorder("<"))
        self._bin.write(flat.tobytes())
        before = self._sizes.total()
        self._sizes.extend(np.asarray(lengths, dtype=np.int32))
        ends = np.arange(1, len(lengths) + 1) if doc_ends is None else np.asarray(doc_ends)
        self._docs.extend(before + ends.astype(np.int64))

    def add_index(self, prefix: str | os.PathLike[str]) -> None:
        """Append a whole existing dataset (same dtype): its tokens, sequences and documents.

        Raises:
            ValueError: the dtypes differ.
        """
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"{prefix}: dtype {other.dtype} differs from the builder's {self.dtype}")
        base = self._sizes.total()
        for s in range(0, len(other), 1 << 22):
            self._sizes.extend(other.sequence_lengths[s:s + (1 << 22)])
        di = other.document_indices
        for s in range(1, len(di), 1 << 22):
            self._docs.extend(di[s:s + (1 << 22)] + base)
        with open(other.bin_path, "rb") as src:
            while block := src.read(1 << 24):
                self._bin.write(block)
        other.close()

    def finalize(self) -> None:
        """Write the ``.idx``, then rename ``.bin`` and ``.idx`` into place (atomic each)."""
        if self._done:
            raise RuntimeError(f"{self.prefix}: builder already finalized")
        self._bin.flush()
        if self.durable:
            os.fsync(self._bin.fileno())
        self._bin.close()
        n, d = self._sizes.total(), self._docs.total()
        itemsize = self.dtype.itemsize
        with open(self._idx_tmp, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<QBQQ", VERSION, self._code, n, d))
            for lens in self._sizes.chunks():
                f.write(lens.astype("<i4").tobytes())
            carry = 0
            for lens in self._sizes.chunks():
                ptr = np.empty(len(lens), dtype="<i8")
                ptr[0] = 0
                np.cumsum(lens[:-1], dtype=np.int64, out=ptr[1:])
                ptr = ptr * itemsize + carry
                carry = int(ptr[-1]) + int(lens[-1]) * itemsize
                f.write(ptr.tobytes())
            for docs in self._docs.chunks():
                f.write(docs.astype("<i8").tobytes())
            f.flush()
            if self.durable:
                os.fsync(f.fileno())
        self._sizes.discard()
        self._docs.discard()
        os.replace(self._bin_tmp, data_file_path(self.prefix))
        os.replace(self._idx_tmp, index_file_path(self.prefix))
        self._done = True

    def abort(self) -> None:
        """Discard everything written so far (the final names are never touched)."""
        if self._done:
            return
        self._bin.close()
        self._sizes.discard()
        self._docs.discard()
        for p in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(p):
                os.remove(p)
        self._done = True

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.finalize()
