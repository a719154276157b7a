"""Checksum algorithms: recorded per file by name, new files CRC-32, version-1 (SHA-256) checkpoints still verified."""

from __future__ import annotations

import hashlib
import json
import zlib

import pytest
import torch

from mg_ckpt import CheckpointError, inspect_checkpoint, load_checkpoint, save_checkpoint
from mg_ckpt._io import file_checksums, file_sha256, new_file_hasher

SHARD = "rank_00000.safetensors"


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(48, 40, generator=g), "b": torch.randn(40, generator=g).bfloat16()}


def _meta(path):
    return json.loads((path / "iter_0000001" / "metadata.json").read_text())


def _write_meta(path, meta) -> None:
    (path / "iter_0000001" / "metadata.json").write_text(json.dumps(meta))


def _flip_byte(path, offset: int = -50) -> None:
    shard = path / "iter_0000001" / SHARD
    data = bytearray(shard.read_bytes())
    data[offset] ^= 0x10
    shard.write_bytes(bytes(data))


def _load(path, verify: bool = True) -> dict[str, torch.Tensor]:
    out = {k: torch.zeros_like(v) for k, v in _state().items()}
    load_checkpoint(str(path), out, verify=verify)
    return out


def test_hashers_match_the_standard_library():
    data = bytes(range(256)) * 1000
    crc, sha = new_file_hasher("crc32"), new_file_hasher("sha256")
    for i in range(0, len(data), 3001):  # incremental updates agree with one-shot digests
        crc.update(data[i : i + 3001])
        sha.update(memoryview(data)[i : i + 3001])
    assert crc.name == "crc32" and crc.hexdigest() == f"{zlib.crc32(data):08x}"
    assert sha.name == "sha256" and sha.hexdigest() == hashlib.sha256(data).hexdigest()
    with pytest.raises(ValueError, match="md5"):
        new_file_hasher("md5")


def test_new_checkpoints_record_crc32_by_name(tmp_path):
    save_checkpoint(str(tmp_path), 1, _state())
    meta = _meta(tmp_path)
    data = (tmp_path / "iter_0000001" / SHARD).read_bytes()
    assert meta["version"] == 2
    assert meta["files"][SHARD] == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    assert file_checksums(str(tmp_path / "iter_0000001" / SHARD), ["crc32", "sha256"]) == {
        "crc32": f"{zlib.crc32(data):08x}",
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    report = inspect_checkpoint(str(tmp_path))
    assert [(f.algorithm, f.digest) for f in report.files] == [("crc32", f"{zlib.crc32(data):08x}")]
    assert "crc32 checksums verified" in report.format()
    _flip_byte(tmp_path)
    with pytest.raises(CheckpointError, match=f"{SHARD}: crc32 checksum mismatch"):
        _load(tmp_path)
    _load(tmp_path, verify=False)  # only verification reads every byte


def _as_version_1(path) -> None:
    """Rewrite the metadata as format version 1 wrote it: SHA-256 of every file (shard files are unchanged)."""
    meta = _meta(path)
    meta["version"] = 1
    for fname, info in meta["files"].items():
        data = (path / "iter_0000001" / fname).read_bytes()
        meta["files"][fname] = {"size": info["size"], "sha256": hashlib.sha256(data).hexdigest()}
    _write_meta(path, meta)


def test_version_1_checkpoints_still_load_and_verify_with_sha256(tmp_path):
    state = _state()
    save_checkpoint(str(tmp_path), 1, state)
    _as_version_1(tmp_path)
    out = _load(tmp_path)
    assert all(torch.equal(out[k], state[k]) for k in state)
    report = inspect_checkpoint(str(tmp_path))
    assert report.format_version == 1 and report.files[0].algorithm == "sha256"
    assert report.files[0].digest == file_sha256(str(tmp_path / "iter_0000001" / SHARD))
    _flip_byte(tmp_path)
    with pytest.raises(CheckpointError, match=f"{SHARD}: sha256 checksum mismatch"):
        _load(tmp_path)
    with pytest.raises(CheckpointError, match=f"{SHARD}: sha256 checksum mismatch"):
        inspect_checkpoint(str(tmp_path))


def test_every_recorded_checksum_is_checked(tmp_path):
    save_checkpoint(str(tmp_path), 1, _state())
    meta = _meta(tmp_path)
    data = (tmp_path / "iter_0000001" / SHARD).read_bytes()
    # A correct CRC-32 does not excuse a wrong SHA-256 recorded beside it.
    meta["files"][SHARD]["sha256"] = hashlib.sha256(data + b"x").hexdigest()
    _write_meta(tmp_path, meta)
    with pytest.raises(CheckpointError, match="sha256 checksum mismatch"):
        _load(tmp_path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m["files"]["rank_00000.safetensors"].pop("crc32"), "checksum string under one of the keys"),
        (lambda m: m["files"]["rank_00000.safetensors"].update(crc32=None), "checksum string under one of the keys"),
        (lambda m: m.update(version=1), "needs a 'sha256' string"),
        (lambda m: m.update(version=3), "format version 3 is not supported"),
    ],
)
def test_missing_or_unknown_checksums_are_refused(tmp_path, edit, message):
    save_checkpoint(str(tmp_path), 1, _state())
    meta = _meta(tmp_path)
    edit(meta)
    _write_meta(tmp_path, meta)
    with pytest.raises(CheckpointError, match=message):
        _load(tmp_path, verify=False)
