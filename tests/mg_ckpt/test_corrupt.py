"""Corrupted, truncated, inconsistent and malicious checkpoints fail with a CheckpointError naming the culprit."""

from __future__ import annotations

import json
import os

import pytest
import torch

from mg_ckpt import CheckpointError, ShardedTensor, inspect_checkpoint, load_checkpoint, save_checkpoint
from mg_parallel.testing import run_distributed

SHARD = "rank_00000.safetensors"


@pytest.fixture
def ckpt(tmp_path):
    g = torch.Generator().manual_seed(1)
    state = {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)}
    save_checkpoint(str(tmp_path), 1, state)
    return tmp_path, state


def _template():
    return {"w": torch.zeros(64, 32), "b": torch.zeros(32)}


def _edit_meta(path, fn):
    meta_path = path / "iter_0000001" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    fn(meta)
    meta_path.write_text(json.dumps(meta))


def test_bit_flip_is_caught_by_checksum(ckpt):
    path, _ = ckpt
    shard = path / "iter_0000001" / SHARD
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x04  # inside the tensor data: the header still parses
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{SHARD}.*checksum"):
        load_checkpoint(str(path), _template())
    with pytest.raises(CheckpointError, match=f"{SHARD}.*checksum"):
        inspect_checkpoint(str(path))
    inspect_checkpoint(str(path), verify=False)  # metadata/headers alone are fine


def test_truncation_is_caught_even_without_verify(ckpt):
    path, _ = ckpt
    shard = path / "iter_0000001" / SHARD
    size = shard.stat().st_size
    os.truncate(shard, size - 1000)
    with pytest.raises(CheckpointError, match=f"{SHARD}.*bytes"):
        load_checkpoint(str(path), _template(), verify=False)


def test_missing_file(ckpt):
    path, _ = ckpt
    os.remove(path / "iter_0000001" / SHARD)
    with pytest.raises(CheckpointError, match=f"{SHARD}.*missing"):
        load_checkpoint(str(path), _template())


@pytest.mark.parametrize("bad_name", ["../evil.safetensors", "/etc/passwd", "sub/x.safetensors", ".hidden"])
def test_path_traversal_in_metadata_is_refused(ckpt, bad_name):
    path, _ = ckpt

    def redirect(meta):
        meta["files"][bad_name] = meta["files"].pop(SHARD)
        for t in meta["tensors"].values():
            for p in t["pieces"]:
                p["file"] = bad_name

    _edit_meta(path, redirect)
    (path / "evil.safetensors").write_bytes((path / "iter_0000001" / SHARD).read_bytes())
    with pytest.raises(CheckpointError, match="refusing file name"):
        load_checkpoint(str(path), _template())


def test_symlink_escaping_the_checkpoint_is_refused(ckpt):
    path, _ = ckpt
    shard = path / "iter_0000001" / SHARD
    outside = path / "outside.safetensors"
    os.replace(shard, outside)
    os.symlink(outside, shard)
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        load_checkpoint(str(path), _template())


def test_wrong_global_shape_names_the_tensor(ckpt):
    path, _ = ckpt
    with pytest.raises(CheckpointError, match="'w' has global shape \\[64, 32\\].*\\[64, 16\\]"):
        load_checkpoint(str(path), {"w": torch.zeros(64, 16)})
    with pytest.raises(CheckpointError, match="'w' has global shape"):
        load_checkpoint(str(path), {"w": ShardedTensor(torch.zeros(32, 32), (128, 32), (0, 0))})


def test_missing_tensor_strict_and_not(ckpt):
    path, state = ckpt
    template = {**_template(), "extra.weight": torch.full((2,), 7.0)}
    with pytest.raises(CheckpointError, match="extra.weight"):
        load_checkpoint(str(path), template)
    with pytest.warns(UserWarning, match="extra.weight"):
        load_checkpoint(str(path), template, strict=False)
    assert torch.equal(template["w"], state["w"]) and torch.equal(template["extra.weight"], torch.full((2,), 7.0))


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda m: m["tensors"]["w"]["pieces"][0].update(offset=[8, 0]), "outside the tensor"),
        (lambda m: m["tensors"]["w"]["pieces"][0].update(shape=[32, 32]), "hold 1024 elements"),
        (lambda m: m["tensors"]["w"]["pieces"].append(dict(m["tensors"]["w"]["pieces"][0])), "stored more than once"),
        (lambda m: m["tensors"]["w"]["pieces"][0].update(file="rank_00009.safetensors"), "not listed"),
        (lambda m: m["tensors"]["w"].update(dtype="F16"), "F32\\[64, 32\\] but metadata.json says F16"),
        (lambda m: m["tensors"]["w"]["pieces"][0].update(key="nope"), "'nope'.*not in the file"),
        (lambda m: m.update(version=99), "version 99"),
        (lambda m: m.pop("files"), "'files' missing"),
    ],
)
def test_inconsistent_metadata(ckpt, corrupt, message):
    path, _ = ckpt
    _edit_meta(path, corrupt)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(str(path), _template(), verify=False)


def test_garbage_metadata_and_latest(ckpt):
    path, _ = ckpt
    (path / "latest").write_text("not-a-number")
    with pytest.raises(CheckpointError, match="latest.*iteration number"):
        load_checkpoint(str(path), _template())
    (path / "latest").write_text("5")
    with pytest.raises(CheckpointError, match="iteration 5"):
        load_checkpoint(str(path), _template())
    (path / "iter_0000001" / "metadata.json").write_text("{ not json")
    with pytest.raises(CheckpointError, match="metadata.json: corrupt JSON"):
        load_checkpoint(str(path / "iter_0000001"), _template())


def corrupt_then_load(path: str) -> str:
    """Rank 0 flips a byte of rank 1's shard; every rank must raise the same error."""
    import torch.distributed as dist

    rank = dist.get_rank()
    save_checkpoint(path, 2, {"w": ShardedTensor.from_split(torch.full((4, 8), float(rank)), 0, rank, 2)})
    if rank == 0:
        shard = os.path.join(path, "iter_0000002", "rank_00001.safetensors")
        data = bytearray(open(shard, "rb").read())
        data[-3] ^= 0xFF
        open(shard, "wb").write(bytes(data))
    dist.barrier()
    try:
        load_checkpoint(path, {"w": ShardedTensor.from_split(torch.zeros(4, 8), 0, rank, 2)})
    except CheckpointError as e:
        return str(e)
    return "no error"


def test_every_rank_raises_when_one_file_is_bad(tmp_path):
    # Files are verified by different ranks; the verdict is shared.
    messages = run_distributed(corrupt_then_load, 2, str(tmp_path))
    assert all("rank_00001.safetensors" in m and "checksum" in m for m in messages), messages


def bad_state_on_one_rank(path: str) -> str:
    """Rank 1 passes a non-tensor; every rank must raise rather than wait for it."""
    import torch.distributed as dist

    value = "oops" if dist.get_rank() == 1 else torch.zeros(2)
    try:
        save_checkpoint(path, 1, {"w": value})
    except CheckpointError as e:
        return str(e)
    return "no error"


def test_a_bad_state_on_one_rank_fails_every_rank(tmp_path):
    messages = run_distributed(bad_state_on_one_rank, 2, str(tmp_path), timeout=60)
    assert all("rank 1" in m and "state['w']" in m for m in messages), messages
    assert not os.path.exists(tmp_path / "latest")
