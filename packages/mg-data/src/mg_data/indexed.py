"""Megatron-compatible indexed datasets: the ``MMIDIDX`` version-1 ``.bin``/``.idx`` pair.

Layout of ``PREFIX.idx`` (little-endian)::

    9 bytes  magic  b"MMIDIDX\\x00\\x00"
    u64      version (1)
    u8       dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
    u64      N, the number of sequences
    u64      D, the length of the document index (number of documents + 1)
    int32    lengths[N]      tokens per sequence
    int64    pointers[N]     byte offset of each sequence in the .bin file
    int64    doc_index[D]    sequence index where each document starts; 0 first, N last

``PREFIX.bin`` holds the tokens of all sequences back to back, no header.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # 34 bytes

DTYPE_CODES: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


class IndexedDatasetError(ValueError):
    """A ``.bin``/``.idx`` pair is missing, malformed or inconsistent; the message names the file."""


def data_file_path(prefix: str | os.PathLike[str]) -> str:
    """Path of the token file of ``prefix`` (``PREFIX.bin``)."""
    return f"{os.fspath(prefix)}.bin"


def index_file_path(prefix: str | os.PathLike[str]) -> str:
    """Path of the index file of ``prefix`` (``PREFIX.idx``)."""
    return f"{os.fspath(prefix)}.idx"


def dtype_code(dtype: np.dtype[Any] | type[np.generic]) -> int:
    """Format code of a numpy dtype; raises ValueError for a dtype the format cannot store."""
    try:
        return _CODE_OF[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"dtype {np.dtype(dtype)} is not storable; use one of "
                         f"{sorted(str(np.dtype(d)) for d in DTYPE_CODES.values())}") from None


def optimal_dtype(vocab_size: int | None) -> type[np.generic]:
    """Smallest token dtype for ``vocab_size`` as Megatron picks it: uint16 below 65500, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def dataset_exists(prefix: str | os.PathLike[str]) -> bool:
    """Whether both ``PREFIX.bin`` and ``PREFIX.idx`` exist."""
    return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


class IndexedDataset:
    """Read-only, memory-mapped view of a ``PREFIX.bin``/``PREFIX.idx`` pair.

    ``ds[i]`` is sequence ``i`` as a read-only numpy array of the stored dtype (a view into the
    mapping: nothing else is read). ``ds.get(i, offset, length)`` reads part of one sequence.
    Memory use does not grow with the corpus: both files are mapped, never loaded.

    Raises:
        IndexedDatasetError: at open, when a file is missing, the magic/version/dtype code is
            wrong, the ``.idx`` size disagrees with its header, or the ``.bin`` size disagrees
            with the last pointer. ``verify()`` runs the full O(N) consistency check.
    """

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        self.prefix = os.fspath(prefix)
        self.idx_path = index_file_path(prefix)
        self.bin_path = data_file_path(prefix)
        for path in (self.idx_path, self.bin_path):
            if not os.path.isfile(path):
                raise IndexedDatasetError(f"{path}: file not found (an indexed dataset needs both "
                                          f"{self.prefix}.bin and {self.prefix}.idx)")
        self._read_index()
        self._open_data()

    def _read_index(self) -> None:
        path = self.idx_path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(HEADER_SIZE)
        if len(head) < len(MAGIC) and MAGIC.startswith(head):
            raise IndexedDatasetError(f"{path}: truncated header ({size} bytes, need {HEADER_SIZE})")
        if head[: len(MAGIC)] != MAGIC:
            raise IndexedDatasetError(f"{path}: bad magic {head[:len(MAGIC)]!r}, expected {MAGIC!r}; "
                                      "not a Megatron MMIDIDX index")
        if len(head) < HEADER_SIZE:
            raise IndexedDatasetError(f"{path}: truncated header ({size} bytes, need {HEADER_SIZE})")
        (version,) = struct.unpack_from("<Q", head, 9)
        if version != VERSION:
            raise IndexedDatasetError(f"{path}: unsupported version {version}, only version {VERSION} "
                                      "is supported")
        (code,) = struct.unpack_from("<B", head, 17)
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{path}: unknown dtype code {code}, expected one of "
                                      f"{sorted(DTYPE_CODES)}")
        n, d = struct.unpack_from("<QQ", head, 18)
        expected = HEADER_SIZE + 4 * n + 8 * n + 8 * d
        if size != expected:
            what = "truncated" if size < expected else "has trailing bytes"
            raise IndexedDatasetError(f"{path}: {what}: {size} bytes but the header ({n} sequences, "
                                      f"{d} document-index entries) implies {expected}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        self._idx_map = np.asarray(np.memmap(path, dtype=np.uint8, mode="r")) if size > 0 else None
        buf = self._idx_map
        off = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(buf, dtype="<i4", count=n, offset=off)
        off += 4 * n
        self.sequence_pointers = np.frombuffer(buf, dtype="<i8", count=n, offset=off)
        off += 8 * n
        self.document_indices = np.frombuffer(buf, dtype="<i8", count=d, offset=off)

    def _open_data(self) -> None:
        size = os.path.getsize(self.bin_path)
        n = len(self.sequence_lengths)
        itemsize = self.dtype.itemsize
        if n:
            first = int(self.sequence_pointers[0])
            end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * itemsize
            if first != 0:
                raise IndexedDatasetError(f"{self.idx_path}: first pointer is {first}, expected 0")
        else:
            end = 0
        if size != end:
            raise IndexedDatasetError(f"{self.bin_path}: size {size} bytes disagrees with "
                                      f"{self.idx_path}, whose last sequence ends at byte {end}")
        if size % itemsize:
            raise IndexedDatasetError(f"{self.bin_path}: size {size} is not a multiple of the "
                                      f"{self.dtype} item size {itemsize}")
        # A plain ndarray view of the map: slicing an np.memmap subclass costs several times more.
        self._bin = (np.asarray(np.memmap(self.bin_path, dtype=self.dtype, mode="r")) if size
                     else np.empty(0, dtype=self.dtype))

    def __getstate__(self) -> dict[str, Any]:
        # Pickle the prefix only (DataLoader workers started with spawn reopen the maps).
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["prefix"])  # type: ignore[misc]

    @property
    def tokens(self) -> np.ndarray:
        """Every token of the ``.bin`` file as one flat read-only array (memory-mapped)."""
        return self._bin

    def __len__(self) -> int:
        """Number of sequences (documents, or sentences of a sentence-split dataset)."""
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        """Number of documents (document-index length minus one)."""
        return max(len(self.document_indices) - 1, 0)

    @property
    def num_tokens(self) -> int:
        """Total number of tokens in the ``.bin`` file."""
        return int(self._bin.shape[0])

    def __getitem__(self, idx: int | slice) -> np.ndarray | list[np.ndarray]:
        """Sequence ``idx`` (an array), or a list of arrays for a slice with step 1."""
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"{self.prefix}: slices must have step 1, got {step}")
            if start >= stop:
                return []
            first = int(self.sequence_pointers[start]) // self.dtype.itemsize
            lengths = self.sequence_lengths[start:stop]
            block = self._bin[first:first + int(lengths.sum(dtype=np.int64))]
            return np.split(block, np.cumsum(lengths[:-1]))
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset:offset+length`` of sequence ``idx`` (to its end when length is None).

        Raises:
            IndexError: ``idx`` out of range, or the window leaves the sequence.
        """
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"{self.prefix}: sequence {idx} out of range [0, {n})")
        size = int(self.sequence_lengths[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"{self.prefix}: window offset={offset} length={length} outside "
                             f"sequence {idx} of length {size}")
        start = int(self.sequence_pointers[idx]) // self.dtype.itemsize + offset
        return self._bin[start:start + length]

    def get_document(self, doc: int) -> np.ndarray:
        """All tokens of document ``doc`` (its sequences concatenated, a copy if more than one)."""
        a, b = int(self.document_indices[doc]), int(self.document_indices[doc + 1])
        if b - a == 1:
            return self.get(a)
        parts = self[a:b]
        return np.concatenate(parts) if parts else np.empty(0, self.dtype)

    def verify(self, chunk: int = 1 << 22) -> None:
        """Full consistency check (O(N), chunked so memory stays bounded).

        Raises:
            IndexedDatasetError: a negative length, pointers that are not the running sum of the
                lengths, or a document index that does not start at 0, end at N and never decrease.
        """
        n, itemsize = len(self), self.dtype.itemsize
        carry = 0
        for s in range(0, n, chunk):
            lens = self.sequence_lengths[s:s + chunk].astype(np.int64)
            if (lens < 0).any():
                bad = s + int(np.argmax(lens < 0))
                raise IndexedDatasetError(f"{self.idx_path}: sequence {bad} has negative length")
            expect = carry + np.concatenate(([0], np.cumsum(lens[:-1]))) * itemsize
            got = self.sequence_pointers[s:s + chunk]
            if not np.array_equal(got, expect):
                bad = s + int(np.argmax(got != expect))
                raise IndexedDatasetError(
                    f"{self.idx_path}: inconsistent pointer for sequence {bad}: "
                    f"{int(self.sequence_pointers[bad])}, expected {int(expect[bad - s])}")
            carry = int(expect[-1]) + int(lens[-1]) * itemsize
        if carry != self.num_tokens * itemsize:
            raise IndexedDatasetError(f"{self.bin_path}: holds {self.num_tokens * itemsize} bytes, "
                                      f"index lengths sum to {carry}")
        di = self.document_indices
        if len(di) == 0 or int(di[0]) != 0 or int(di[-1]) != n:
            raise IndexedDatasetError(f"{self.idx_path}: document index must start at 0 and end at "
                                      f"{n}, got {di[:1].tolist()}...{di[-1:].tolist()}")
        for s in range(0, len(di), chunk):
            part = di[s:s + chunk + 1]
            if (np.diff(part) < 0).any():
                raise IndexedDatasetError(f"{self.idx_path}: document index decreases near entry "
                                          f"{s + int(np.argmax(np.diff(part) < 0))}")

    def summary(self) -> dict[str, Any]:
        """Counts for display (``mg inspect``): sequences, documents, tokens, dtype, sizes."""
        lens = self.sequence_lengths
        return {
            "prefix": self.prefix,
            "dtype": str(self.dtype),
            "num_sequences": len(self),
            "num_documents": self.num_documents,
            "num_tokens": self.num_tokens,
            "bin_bytes": os.path.getsize(self.bin_path),
            "idx_bytes": os.path.getsize(self.idx_path),
            "min_sequence_length": int(lens.min()) if len(lens) else 0,
            "max_sequence_length": int(lens.max()) if len(lens) else 0,
            "mean_sequence_length": float(lens.mean()) if len(lens) else 0.0,
        }

    def close(self) -> None:
        """Drop the memory maps (arrays returned earlier stay valid while referenced)."""
        self._bin = np.empty(0, dtype=self.dtype)
        self._idx_map = None

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}, sequences={len(self)}, documents={self.num_documents}, "
                f"dtype={self.dtype})")


def inspect_dataset(prefix: str | os.PathLike[str]) -> dict[str, Any]:
    """Open, fully verify and summarise a dataset (the library side of ``mg inspect PREFIX``).

    Raises:
        IndexedDatasetError: the pair is missing or inconsistent (message names the file).
    """
    ds = IndexedDataset(prefix)
    ds.verify()
    out = ds.summary()
    out["verified"] = True
    return out


# The writer lives in its own module; it is re-exported here so both names work.
from mg_data.indexed_builder import IndexedDatasetBuilder  # noqa: E402

__all__ = ["IndexedDataset", "IndexedDatasetBuilder", "IndexedDatasetError", "dataset_exists", "dtype_code",
           "inspect_dataset", "optimal_dtype", "data_file_path", "index_file_path"]
