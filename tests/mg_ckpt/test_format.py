"""Box arithmetic, the safetensors writer and the on-disk format, against independent references."""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import random
import zlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from mg_ckpt import ShardedTensor, inspect_checkpoint, latest_iteration, load_checkpoint, save_checkpoint
from mg_ckpt._io import write_safetensors
from mg_ckpt.sharded import flat_range_to_boxes


def test_flat_range_boxes_cover_exactly_the_range():
    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 4)))
        n = math.prod(shape)
        a = rng.randint(0, n)
        b = rng.randint(a, n)
        index = torch.arange(n).view(shape)
        got = []
        boxes = flat_range_to_boxes(a, b, shape)
        assert len(boxes) <= 2 * len(shape) - 1
        for box in boxes:
            part = index[tuple(slice(s, s + k) for s, k in zip(box.start, box.shape))].reshape(-1)
            # Each box is contiguous in the flattening and starts where it says.
            assert part.tolist() == list(range(box.flat_start, box.flat_start + box.numel))
            got += part.tolist()
        assert sorted(got) == list(range(a, b))


def test_sharded_tensor_validates_its_description():
    with pytest.raises(ValueError, match="along dim 1"):
        ShardedTensor(torch.zeros(2, 3), (2, 4), (0, 2))
    with pytest.raises(ValueError, match="flat_range"):
        ShardedTensor(torch.zeros(5), (4, 4), (0, 0), (2, 4), (4, 10))
    with pytest.raises(ValueError, match="selects"):
        ShardedTensor(torch.zeros(5), (4, 4), (0, 0), (2, 4), (0, 4))
    with pytest.raises(ValueError, match="replica_rank"):
        ShardedTensor(torch.zeros(2), (2,), replica_rank=2, num_replicas=2)
    st = ShardedTensor.from_split(torch.zeros(3, 4), 1, 2, 3)
    assert st.global_shape == (3, 12) and st.global_offset == (0, 8)


def test_writer_output_is_standard_safetensors(tmp_path):
    path = str(tmp_path / "x.safetensors")
    items = [("a", torch.randn(7, 3)), ("b", torch.arange(5, dtype=torch.int32)), ("c", torch.randn(4).bfloat16())]
    info = write_safetensors(path, items, {"format": "pt"})
    loaded = load_file(path)
    for name, t in items:
        assert torch.equal(loaded[name], t)
    with open(path, "rb") as f:
        data = f.read()
    assert info.size == len(data) and info.algorithm == "crc32" and info.digest == f"{zlib.crc32(data):08x}"
    sha = write_safetensors(path, items, {"format": "pt"}, checksum="sha256")
    assert sha.size == len(data) and sha.sha256 == hashlib.sha256(data).hexdigest()
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_layout_on_disk_and_no_pickle(tmp_path, monkeypatch):
    w = torch.randn(4, 6)
    save_checkpoint(str(tmp_path), 12, {"w": w}, extra={"rng": [1, 2, 3], "lr": 0.5}, layout={"tp": 1})
    assert latest_iteration(str(tmp_path)) == 12
    assert open(tmp_path / "latest").read().strip() == "12"
    ckpt = tmp_path / "iter_0000012"
    assert sorted(os.listdir(ckpt)) == ["metadata.json", "rank_00000.safetensors"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]
    meta = json.loads((ckpt / "metadata.json").read_text())
    assert meta["tensors"]["w"]["shape"] == [4, 6] and meta["tensors"]["w"]["dtype"] == "F32"
    assert meta["state"] == {"rng": [1, 2, 3], "lr": 0.5}
    data = (ckpt / "rank_00000.safetensors").read_bytes()
    assert meta["version"] == 2
    assert meta["files"]["rank_00000.safetensors"] == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}

    def refuse(*args, **kwargs):
        raise AssertionError("loading must not unpickle")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    out = {"w": torch.zeros(4, 6)}
    extra = load_checkpoint(str(tmp_path), out)
    assert torch.equal(out["w"], w) and extra["lr"] == 0.5 and extra["iteration"] == 12


def test_inspect_reports_tensors_sizes_and_verifies(tmp_path):
    save_checkpoint(str(tmp_path), 3, {"a": torch.zeros(10, 4), "b": torch.zeros(3, dtype=torch.bfloat16)}, layout={"tp": 2})
    report = inspect_checkpoint(str(tmp_path))
    assert report.iteration == 3 and report.verified and report.layout == {"tp": 2}
    by_name = {t.name: t for t in report.tensors}
    assert by_name["a"].nbytes == 160 and by_name["b"].dtype == "BF16" and by_name["b"].shape == (3,)
    assert report.total_bytes == os.path.getsize(tmp_path / "iter_0000003" / "rank_00000.safetensors")
    text = report.format()
    assert "iteration 3" in text and "a  F32[10, 4]" in text


def test_resave_same_iteration_replaces_it(tmp_path):
    save_checkpoint(str(tmp_path), 4, {"w": torch.zeros(3)})
    save_checkpoint(str(tmp_path), 4, {"w": torch.ones(3)})
    out = {"w": torch.zeros(3)}
    load_checkpoint(str(tmp_path), out)
    assert torch.equal(out["w"], torch.ones(3))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_bad_arguments_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="JSON"):
        save_checkpoint(str(tmp_path), 1, {"w": torch.zeros(1)}, extra={"t": torch.zeros(1)})
    with pytest.raises(ValueError, match="keep_last"):
        save_checkpoint(str(tmp_path), 1, {"w": torch.zeros(1)}, keep_last=0)
    with pytest.raises(ValueError, match="iteration"):
        save_checkpoint(str(tmp_path), -1, {"w": torch.zeros(1)})
    assert latest_iteration(str(tmp_path)) is None


def test_slices_with_long_runs_and_odd_destinations(tmp_path):
    # Rows of 16 KiB: column halves are 8 KiB runs (read with positioned reads); a 3-D box with a
    # partial middle dim; a non-contiguous destination (strided copy path); a flat range target.
    g = torch.Generator().manual_seed(3)
    w, c = torch.randn(16, 4096, generator=g), torch.randn(4, 6, 1024, generator=g)
    save_checkpoint(str(tmp_path), 1, {"w": w, "c": c})
    for r in range(2):
        half = ShardedTensor.from_split(torch.zeros(16, 2048), 1, r, 2)
        box = ShardedTensor(torch.zeros(2, 3, 1024), (4, 6, 1024), (1, 2, 0))
        load_checkpoint(str(tmp_path), {"w": half, "c": box})
        assert torch.equal(half.local, w[:, r * 2048 : (r + 1) * 2048])
        assert torch.equal(box.local, c[1:3, 2:5])
    transposed = torch.zeros(4096, 16).t()  # a [16, 4096] view with non-contiguous strides
    load_checkpoint(str(tmp_path), {"w": transposed}, strict=False)
    assert torch.equal(transposed, w)
    flat = ShardedTensor(torch.zeros(5000), (16, 4096), (0, 2048), (16, 2048), (1000, 6000))
    load_checkpoint(str(tmp_path), {"w": flat})
    assert torch.equal(flat.local, w[:, 2048:].reshape(-1)[1000:6000])


def test_writer_flushes_early_and_reports_flush_errors(tmp_path, monkeypatch):
    import threading

    import mg_ckpt._io as io_mod

    monkeypatch.setattr(io_mod, "_CHUNK", 4096)
    monkeypatch.setattr(io_mod, "_FLUSH_EVERY", 8192)
    real, flushed, failed = os.fdatasync, threading.Event(), threading.Event()

    def counting(fd):
        real(fd)
        flushed.set()

    monkeypatch.setattr(os, "fdatasync", counting)
    items = [("a", torch.randn(64, 256)), ("b", torch.arange(3000, dtype=torch.int64))]
    path = str(tmp_path / "x.safetensors")
    info = write_safetensors(path, items)  # output intact whether or not a flush ran meanwhile
    loaded = load_file(path)
    assert all(torch.equal(loaded[n], t) for n, t in items) and info.size == os.path.getsize(path)
    with open(tmp_path / "z.bin", "wb", buffering=0) as f, io_mod._EarlyFlush(f.fileno()) as flusher:
        f.write(b"x" * 10000)
        flusher.written(10000)
        assert flushed.wait(30)  # a flush starts before the file is complete

    def failing(fd):
        failed.set()
        raise OSError(5, "Input/output error (injected)")

    monkeypatch.setattr(os, "fdatasync", failing)
    with pytest.raises(OSError, match="injected"):
        with open(tmp_path / "y.bin", "wb", buffering=0) as f, io_mod._EarlyFlush(f.fileno()) as flusher:
            f.write(b"x" * 10000)
            flusher.written(10000)
            assert failed.wait(30)
