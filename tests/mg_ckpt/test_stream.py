"""Streaming checkpoint writer and per-tensor reader: format, resharding, verification, crash safety."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from mg_ckpt import (
    CheckpointError,
    CheckpointReader,
    ShardedTensor,
    StreamingCheckpointWriter,
    inspect_checkpoint,
    latest_iteration,
    load_checkpoint,
    save_checkpoint,
)
from mg_ckpt.stream import plan_files
from mg_parallel.testing import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_state(seed: int) -> dict[str, torch.Tensor]:
    """Mixed dtypes and odd sizes, so that shards split for size and for alignment."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model/emb": torch.randn(12, 8, generator=g),
        "model/norm": torch.randn(8, generator=g).bfloat16(),
        "model/odd": torch.randn(3, generator=g).bfloat16(),  # 6 bytes: the next f32 needs a new file
        "model/w": torch.randn(8, 10, generator=g),
        "model/steps": torch.arange(5, dtype=torch.int64) * seed,
        "model/big": torch.randn(64, 16, generator=g),
    }


def stream_save(save_dir, iteration: int, state: dict[str, torch.Tensor], max_shard_bytes: int = 600) -> str:
    specs = [(n, t.shape, t.dtype) for n, t in state.items()]
    with StreamingCheckpointWriter(str(save_dir), iteration, specs, extra={"note": "hi"}, layout={"tp": 2},
                                   max_shard_bytes=max_shard_bytes) as w:
        for n, t in state.items():
            w.write(n, t)
    return w.path


def test_stream_written_checkpoint_loads_reshards_and_verifies(tmp_path):
    state = make_state(1)
    path = stream_save(tmp_path, 3, state)
    assert latest_iteration(str(tmp_path)) == 3
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    assert len(files) == 3  # [emb norm odd] [w steps] [big]: 600-byte shards
    for f in files:  # standard safetensors, every tensor aligned to its element size
        with safe_open(os.path.join(path, f), framework="pt") as st:
            for k in st.keys():
                assert torch.equal(st.get_tensor(k), state[k])
    # File entries carry the same checksum algorithm as save_checkpoint's.
    save_checkpoint(str(tmp_path / "ref"), 0, {"x": torch.ones(3)})
    ref_meta = json.loads((tmp_path / "ref" / "iter_0000000" / "metadata.json").read_text())
    meta = json.loads((tmp_path / "iter_0000003" / "metadata.json").read_text())
    assert {frozenset(e) for e in meta["files"].values()} == {frozenset(e) for e in ref_meta["files"].values()}
    assert meta["version"] == ref_meta["version"]
    report = inspect_checkpoint(str(tmp_path), verify=True)
    assert report.verified and report.iteration == 3 and {t.name for t in report.tensors} == set(state)

    template = {n: torch.empty_like(t) for n, t in state.items()}
    extra = load_checkpoint(str(tmp_path), template, verify=True)
    assert extra == {"note": "hi", "iteration": 3}
    for n, t in state.items():
        assert torch.equal(template[n], t), n
    # Resharded: rank 1 of a tp=2 row split, and a flat range of that block (a distributed optimizer's piece).
    half = ShardedTensor.from_split(torch.empty(6, 8), 0, 1, 2)
    flat = ShardedTensor(torch.empty(20), global_shape=(64, 16), global_offset=(32, 0), local_shape=(32, 16),
                         flat_range=(100, 120))
    load_checkpoint(str(tmp_path), {"model/emb": half, "model/big": flat})
    assert torch.equal(half.local, state["model/emb"][6:])
    assert torch.equal(flat.local, state["model/big"][32:].reshape(-1)[100:120])

    reader = CheckpointReader(str(tmp_path))
    assert reader.iteration == 3 and reader.extra["note"] == "hi" and reader.layout == {"tp": 2}
    got = dict(iter(reader))
    assert list(got) == list(state) and all(torch.equal(got[n], state[n]) for n in state)


def test_plan_keeps_every_tensor_aligned():
    bf16, f32, i64 = torch.bfloat16, torch.float32, torch.int64
    specs = [("a", (3,), bf16), ("b", (2,), f32), ("c", (2,), bf16), ("d", (1,), i64), ("e", (4,), f32)]
    plan = plan_files(specs, 1 << 20)
    # 6 bytes of bf16 would put "b" at offset 6; 8 bytes of b+4 of c put "d" at 4 of its new file.
    assert [[s[0] for s in f] for f in plan] == [["a"], ["b", "c"], ["d", "e"]]
    assert [[s[0] for s in f] for f in plan_files(specs[3:], 8)] == [["d"], ["e"]]


def _save_tp2(save_dir: str) -> None:
    # Two ranks each hold half of a tensor (rows) and a flat half of another: pieces to assemble.
    rank = torch.distributed.get_rank()
    full = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    rows = ShardedTensor.from_split(full[rank * 4 : (rank + 1) * 4].clone(), 0, rank, 2)
    vec = torch.arange(10, dtype=torch.float32)
    flat = ShardedTensor(vec[rank * 5 : rank * 5 + 5].clone(), global_shape=(10,), global_offset=(0,),
                         local_shape=(10,), flat_range=(rank * 5, rank * 5 + 5))
    save_checkpoint(save_dir, 7, {"rows": rows, "flat": flat, "rep": torch.ones(3)}, extra={"k": 1})


def test_reader_assembles_pieces_saved_by_several_ranks(tmp_path):
    run_distributed(_save_tp2, 2, str(tmp_path))
    reader = CheckpointReader(str(tmp_path))
    assert reader.specs["rows"] == ((8, 6), torch.float32)
    out = reader.read(["rows", "flat"])
    assert torch.equal(out["rows"], torch.arange(48, dtype=torch.float32).reshape(8, 6))
    assert torch.equal(out["flat"], torch.arange(10, dtype=torch.float32))
    with pytest.raises(CheckpointError, match="nope"):
        reader.read(["nope"])


def test_corruption_is_caught_by_every_reader(tmp_path):
    path = stream_save(tmp_path, 1, make_state(2))
    victim = os.path.join(path, sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[-1])
    with open(victim, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x40]))
    name = os.path.basename(victim)
    with pytest.raises(CheckpointError, match=name):
        load_checkpoint(str(tmp_path), {n: torch.empty_like(t) for n, t in make_state(2).items()})
    with pytest.raises(CheckpointError, match=name):
        inspect_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointError, match=name):
        CheckpointReader(str(tmp_path))


def test_writer_rejects_misuse_and_aborts_cleanly(tmp_path):
    stream_save(tmp_path, 1, make_state(1))
    state = make_state(2)
    specs = [(n, t.shape, t.dtype) for n, t in state.items()]
    w = StreamingCheckpointWriter(str(tmp_path), 2, specs)
    with pytest.raises(ValueError, match="expected tensor 'model/emb' next"):
        w.write("model/w", state["model/w"])
    with pytest.raises(ValueError, match="declared"):
        w.write("model/emb", state["model/emb"].double())
    w.write("model/emb", state["model/emb"])
    with pytest.raises(ValueError, match="commit before tensors"):
        w.commit()
    assert not os.path.exists(tmp_path / ".tmp_iter_0000002")
    with pytest.raises(RuntimeError, match="boom"), StreamingCheckpointWriter(str(tmp_path), 2, specs) as w2:
        w2.write("model/emb", state["model/emb"])
        raise RuntimeError("boom")
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", "latest"]
    with pytest.raises(ValueError, match="JSON"):
        StreamingCheckpointWriter(str(tmp_path), 3, specs, extra={"x": object()})


def crash_child(save_dir: str) -> None:
    """Write iteration 2 and die (no cleanup, no exception handling) just before the rename."""
    from mg_ckpt import stream

    def die(step: str) -> None:
        if step == "before_rename":
            os._exit(17)

    stream._fault_hook = die
    stream_save(save_dir, 2, make_state(2))


def test_crash_before_rename_leaves_previous_checkpoint(tmp_path):
    stream_save(tmp_path, 1, make_state(1))
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", f"from tests.mg_ckpt.test_stream import crash_child; "
                           f"crash_child({str(tmp_path)!r})"], env=env, timeout=120)
    assert proc.returncode == 17
    tmp = tmp_path / ".tmp_iter_0000002"
    assert (tmp / "metadata.json").is_file()  # everything was written, only the rename is missing
    assert latest_iteration(str(tmp_path)) == 1 and not (tmp_path / "iter_0000002").exists()
    template = {n: torch.empty_like(t) for n, t in make_state(1).items()}
    assert load_checkpoint(str(tmp_path), template)["iteration"] == 1
    assert all(torch.equal(template[n], t) for n, t in make_state(1).items())
    stream_save(tmp_path, 2, make_state(2))  # the next save removes the leftover and commits
    assert not tmp.exists() and latest_iteration(str(tmp_path)) == 2
    meta = json.loads((tmp_path / "iter_0000002" / "metadata.json").read_text())
    assert all(p["flat_range"] is None for t in meta["tensors"].values() for p in t["pieces"])
