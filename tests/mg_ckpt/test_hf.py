"""Streaming Hugging Face safetensors directories: format, and peak memory well below the model size."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from mg_ckpt import CheckpointError, iter_hf_safetensors, read_hf_index, write_hf_safetensors

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1 << 20


def weights(n: int, numel: int):
    """``n`` generated tensors, produced lazily (nothing else holds them)."""
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        yield f"layers.{i}.weight", torch.randn(numel, generator=g)


def expected(name: str, numel: int) -> torch.Tensor:
    i = int(name.split(".")[1])
    return torch.randn(numel, generator=torch.Generator().manual_seed(i))


def peak_rss() -> int:
    """This process's peak RSS in bytes (``VmHWM``: unlike ``ru_maxrss``, not inherited from the forking parent)."""
    with open("/proc/self/status") as f:
        return int(f.read().split("VmHWM:")[1].split()[0]) * 1024


def write_child(out_dir: str, n: int, numel: int, max_shard: int, planned: bool = False) -> None:
    """Write in a fresh process and print the peak-RSS increase in bytes (``planned``: with specs)."""
    expected("layers.0.weight", numel)  # warm the allocator and generator once
    base = peak_rss()
    specs = [(f"layers.{i}.weight", (numel,), torch.float32) for i in range(n)] if planned else None
    write_hf_safetensors(out_dir, weights(n, numel), max_shard, specs=specs)
    print(peak_rss() - base)


def read_child(out_dir: str, numel: int) -> None:
    """Read everything back one tensor at a time, check it, print the peak-RSS increase."""
    expected("layers.0.weight", numel)
    base = peak_rss()
    count = 0
    for name, t in iter_hf_safetensors(out_dir):
        assert torch.equal(t, expected(name, numel)), name
        count += 1
    print(count, peak_rss() - base)


def _run(code: str) -> str:
    # A fixed mmap threshold makes glibc return freed tensor memory to the OS at once, so the peak
    # RSS measures the memory actually held (with the dynamic default, freed 8 MiB blocks may be
    # kept in the heap and counted, whatever the code under test does).
    env = {
        **os.environ,
        "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "MALLOC_MMAP_THRESHOLD_": str(1 << 20),
    }
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_streaming_write_and_read_stay_within_memory_bound(tmp_path):
    n, numel, max_shard = 24, MiB, 8 * MiB  # 24 tensors of 4 MiB: a 96 MiB model, 2 per shard
    tensor_bytes, model_bytes = numel * 4, n * numel * 4
    bound = max_shard + tensor_bytes + 12 * MiB  # one shard + the incoming tensor + slack
    assert bound < model_bytes / 3
    grew = int(_run(f"from tests.mg_ckpt.test_hf import write_child; write_child({str(tmp_path)!r}, {n}, {numel}, {max_shard})"))
    assert grew < bound, f"writer peak RSS grew by {grew / MiB:.0f} MiB (bound {bound / MiB:.0f} MiB)"
    count, grew = map(int, _run(f"from tests.mg_ckpt.test_hf import read_child; read_child({str(tmp_path)!r}, {numel})").split())
    assert count == n
    bound = 2 * tensor_bytes + 12 * MiB  # the tensor read + the reference it is compared with
    assert grew < bound, f"reader peak RSS grew by {grew / MiB:.0f} MiB (bound {bound / MiB:.0f} MiB)"

    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    assert files == [f"model-{i:05d}-of-00012.safetensors" for i in range(1, 13)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == model_bytes
    assert index["weight_map"]["layers.5.weight"] == "model-00003-of-00012.safetensors"

    # Planned from specs, each tensor goes straight to disk: one 96 MiB shard, one tensor in memory.
    planned = tmp_path / "planned"
    grew = int(_run(f"from tests.mg_ckpt.test_hf import write_child; "
                    f"write_child({str(planned)!r}, {n}, {numel}, {model_bytes}, planned=True)"))
    bound = tensor_bytes + 12 * MiB
    assert grew < bound, f"planned writer peak RSS grew by {grew / MiB:.0f} MiB (bound {bound / MiB:.0f} MiB)"
    assert os.listdir(planned) and sorted(os.listdir(planned)) == ["model-00001-of-00001.safetensors",
                                                                   "model.safetensors.index.json"]
    got = [name for name, t in iter_hf_safetensors(str(planned)) if torch.equal(t, expected(name, numel))]
    assert got == [f"layers.{i}.weight" for i in range(n)]


def test_planned_writer_checks_the_tensors_against_specs(tmp_path):
    tensors = {"a": torch.randn(3, 5), "c": torch.randn(3).bfloat16(), "b": torch.arange(7), "d": torch.randn(100)}
    specs = [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    index = write_hf_safetensors(str(tmp_path), iter(tensors.items()), max_shard_bytes=100, specs=specs)
    # 60 B of "a" + 6 B of "c": "b" (8-byte elements) starts a new file; "d" (400 B) gets its own.
    assert len(set(index["weight_map"].values())) == 3
    seen = {}
    for fname in sorted(set(index["weight_map"].values())):
        seen.update(load_file(str(tmp_path / fname)))
    assert all(torch.equal(seen[k], tensors[k]) for k in tensors) and seen.keys() == tensors.keys()
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ValueError, match="expected tensor 'c' next"):
        write_hf_safetensors(str(tmp_path), iter([("a", tensors["a"]), ("b", tensors["b"])]), specs=specs)
    with pytest.raises(ValueError, match="declared"):
        write_hf_safetensors(str(tmp_path), iter([("a", tensors["a"].double())]), specs=specs)
    with pytest.raises(ValueError, match="iterator ended before tensor 'b'"):
        write_hf_safetensors(str(tmp_path), iter(list(tensors.items())[:2]), specs=specs)
    with pytest.raises(ValueError, match="'e' was not declared"):
        write_hf_safetensors(str(tmp_path), iter([*tensors.items(), ("e", torch.ones(1))]), specs=specs)
    assert sorted(os.listdir(tmp_path)) == before  # failed writes leave the directory as it was


def test_files_are_readable_by_safetensors_itself(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7), "c": torch.randn(2, 2).bfloat16(), "d": torch.randn(100)}
    index = write_hf_safetensors(str(tmp_path), iter(tensors.items()), max_shard_bytes=100)
    assert set(index["weight_map"]) == set(tensors)
    seen = {}
    for fname in sorted(set(index["weight_map"].values())):
        loaded = load_file(str(tmp_path / fname))
        assert all(index["weight_map"][k] == fname for k in loaded)
        seen.update(loaded)
    assert seen.keys() == tensors.keys() and all(torch.equal(seen[k], tensors[k]) for k in tensors)
    # Re-writing with fewer shards replaces the old set of files.
    write_hf_safetensors(str(tmp_path), iter(tensors.items()))
    assert sorted(os.listdir(tmp_path)) == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]


def test_reader_accepts_a_single_file_and_a_subset(tmp_path):
    tensors = {"x": torch.randn(4, 4), "y": torch.randn(3)}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert read_hf_index(str(tmp_path)) == {"x": "model.safetensors", "y": "model.safetensors"}
    got = dict(iter_hf_safetensors(str(tmp_path), names=["y"]))
    assert list(got) == ["y"] and torch.equal(got["y"], tensors["y"])
    with pytest.raises(CheckpointError, match="'z'"):
        list(iter_hf_safetensors(str(tmp_path), names=["z"]))


def test_reader_refuses_escaping_index_and_truncated_files(tmp_path):
    write_hf_safetensors(str(tmp_path), iter({"w": torch.randn(64)}.items()))
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = tmp_path / index["weight_map"]["w"]
    os.truncate(shard, shard.stat().st_size - 8)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        list(iter_hf_safetensors(str(tmp_path)))
    index["weight_map"]["w"] = "../../etc/passwd"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="refusing file name"):
        read_hf_index(str(tmp_path))
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json"):
        read_hf_index(str(tmp_path / "nowhere"))
