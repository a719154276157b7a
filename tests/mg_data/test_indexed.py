"""The .bin/.idx format: exact bytes against a hand-built fixture, round trips, validation errors."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from mg_data.indexed import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    inspect_dataset,
    optimal_dtype,
)

# Three documents; the second has two sequences (sentences). dtype uint16 (code 8).
DOCS = [[[5, 6, 7]], [[1], [65000, 2]], [[9, 9, 9, 9]]]


def hand_built_bytes() -> tuple[bytes, bytes]:
    """The .idx and .bin of DOCS written straight from the format description, by hand."""
    lengths = [3, 1, 2, 4]
    pointers = [0, 6, 8, 12]  # byte offsets: 2 bytes per uint16 token
    doc_index = [0, 1, 3, 4]
    idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
    idx += struct.pack("<Q", 4) + struct.pack("<Q", 4)
    idx += struct.pack("<4i", *lengths) + struct.pack("<4q", *pointers) + struct.pack("<4q", *doc_index)
    tokens = [5, 6, 7, 1, 65000, 2, 9, 9, 9, 9]
    return idx, struct.pack(f"<{len(tokens)}H", *tokens)


def write_pair(prefix, idx: bytes, bin_: bytes) -> str:
    with open(f"{prefix}.idx", "wb") as f:
        f.write(idx)
    with open(f"{prefix}.bin", "wb") as f:
        f.write(bin_)
    return str(prefix)


def test_builder_writes_exact_bytes(tmp_path):
    prefix = tmp_path / "built"
    b = IndexedDatasetBuilder(prefix, np.uint16)
    for doc in DOCS:
        flat = [t for s in doc for t in s]
        b.add_document(flat, [len(s) for s in doc])
    b.finalize()
    idx, bin_ = hand_built_bytes()
    assert (tmp_path / "built.idx").read_bytes() == idx
    assert (tmp_path / "built.bin").read_bytes() == bin_


def test_reader_on_hand_built_fixture(tmp_path):
    prefix = write_pair(tmp_path / "hand", *hand_built_bytes())
    ds = IndexedDataset(prefix)
    ds.verify()
    assert len(ds) == 4 and ds.num_documents == 3 and ds.num_tokens == 10 and ds.dtype == np.uint16
    assert [x.tolist() for x in ds[0:4]] == [s for d in DOCS for s in d]
    assert ds[2].tolist() == [65000, 2]
    assert ds.get(3, offset=1, length=2).tolist() == [9, 9]
    assert ds.get_document(1).tolist() == [1, 65000, 2]
    assert ds.document_indices.tolist() == [0, 1, 3, 4]
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=2)
    with pytest.raises(IndexError):
        ds.get(4)
    s = inspect_dataset(prefix)
    assert (s["num_sequences"], s["num_documents"], s["num_tokens"], s["dtype"]) == (4, 3, 10, "uint16")


def test_round_trip_random_all_dtypes_and_streaming_spill(tmp_path):
    rng = np.random.default_rng(0)
    for dtype in (np.uint8, np.int8, np.int16, np.int32, np.int64, np.float64, np.float32, np.uint16):
        seqs = [rng.integers(0, 100, size=rng.integers(0, 50)).astype(dtype) for _ in range(300)]
        prefix = tmp_path / f"rt_{np.dtype(dtype).name}"
        with IndexedDatasetBuilder(prefix, dtype) as b:
            b._sizes.limit = b._docs.limit = 7  # force many spills to disk
            for i, s in enumerate(seqs):
                b.add_item(s)
                if i % 3 == 2:
                    b.end_document()
        ds = IndexedDataset(prefix)
        ds.verify()
        assert ds.dtype == dtype and len(ds) == 300 and ds.num_documents == 100
        for i in (0, 17, 299):
            np.testing.assert_array_equal(ds[i], seqs[i])


def test_merge_with_add_index(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    with IndexedDatasetBuilder(a, np.uint16) as w:
        w.add_document([1, 2, 3])
        w.add_document([4], )
    with IndexedDatasetBuilder(b, np.uint16) as w:
        w.add_document([5, 6], [1, 1])
    with IndexedDatasetBuilder(tmp_path / "m", np.uint16) as w:
        w.add_index(a)
        w.add_document([7])
        w.add_index(b)
    m = IndexedDataset(tmp_path / "m")
    m.verify()
    assert [x.tolist() for x in m[0:len(m)]] == [[1, 2, 3], [4], [7], [5], [6]]
    assert m.document_indices.tolist() == [0, 1, 2, 3, 5]
    with pytest.raises(ValueError, match="dtype"), IndexedDatasetBuilder(tmp_path / "x", np.int32) as w:
        w.add_index(a)


def test_crash_leaves_no_valid_looking_files(tmp_path):
    with pytest.raises(RuntimeError), IndexedDatasetBuilder(tmp_path / "c", np.uint16) as w:
        w.add_document([1, 2])
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []
    w = IndexedDatasetBuilder(tmp_path / "d", np.uint16)
    w.add_document([1, 2])
    assert not (tmp_path / "d.bin").exists() and not (tmp_path / "d.idx").exists()
    w.finalize()
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]


def test_optimal_dtype_and_range_check(tmp_path):
    assert optimal_dtype(32000) == np.uint16 and optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32 and optimal_dtype(128256) == np.int32
    with pytest.raises(ValueError, match="do not fit"), IndexedDatasetBuilder(tmp_path / "r", np.uint16) as w:
        w.add_item(np.array([70000]))


def _corrupt(tmp_path, name, idx: bytes, bin_: bytes):
    return write_pair(tmp_path / name, idx, bin_)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda i, b: (b"XXIDIDX\x00\x00" + i[9:], b), "bad magic"),
        (lambda i, b: (i[:9] + struct.pack("<Q", 2) + i[17:], b), "unsupported version 2"),
        (lambda i, b: (i[:17] + b"\x09" + i[18:], b), "unknown dtype code 9"),
        (lambda i, b: (i[:-5], b), "truncated"),
        (lambda i, b: (i[:20], b), "truncated"),
        (lambda i, b: (i[:5], b), "truncated header"),
        (lambda i, b: (i + b"\x00", b), "trailing bytes"),
        (lambda i, b: (i, b[:-2]), "disagrees"),
        (lambda i, b: (i, b + b"\x00\x00"), "disagrees"),
        (lambda i, b: (i[:34 + 16] + struct.pack("<q", 2) + i[34 + 24:], b), "first pointer"),
    ],
)
def test_open_time_validation(tmp_path, mutate, message):
    prefix = _corrupt(tmp_path, "bad", *mutate(*hand_built_bytes()))
    with pytest.raises(IndexedDatasetError, match=message) as e:
        IndexedDataset(prefix)
    assert "bad." in str(e.value)  # names the file


def test_verify_finds_inconsistent_pointers_and_document_index(tmp_path):
    idx, bin_ = hand_built_bytes()
    ptr_off = 34 + 16
    bad_ptr = idx[:ptr_off + 8] + struct.pack("<q", 4) + idx[ptr_off + 16:]
    ds = IndexedDataset(_corrupt(tmp_path, "p", bad_ptr, bin_))
    with pytest.raises(IndexedDatasetError, match="inconsistent pointer for sequence 1"):
        ds.verify()
    doc_off = ptr_off + 32
    bad_doc = idx[:doc_off + 8] + struct.pack("<q", 3) + struct.pack("<q", 1) + idx[doc_off + 24:]
    ds = IndexedDataset(_corrupt(tmp_path, "d", bad_doc, bin_))
    with pytest.raises(IndexedDatasetError, match="document index decreases"):
        ds.verify()
    bad_end = idx[:-8] + struct.pack("<q", 3)
    with pytest.raises(IndexedDatasetError, match="must start at 0 and end at 4"):
        IndexedDataset(_corrupt(tmp_path, "e", bad_end, bin_)).verify()


def test_missing_file_is_named(tmp_path):
    prefix = _corrupt(tmp_path, "m", *hand_built_bytes())
    os.remove(f"{prefix}.bin")
    with pytest.raises(IndexedDatasetError, match=r"m\.bin: file not found"):
        IndexedDataset(prefix)
