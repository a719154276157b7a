"""Strided slice reads (column shards, boxes) through the memory map vs positioned reads: bit-exact at many shapes."""

from __future__ import annotations

import pytest
import torch

import mg_ckpt.load as load_mod
from mg_ckpt import ShardedTensor, load_checkpoint, save_checkpoint


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=g).to(dtype)


# (global shape, dtype, tp along the last dim): runs of 4 B .. 2 MiB, odd widths whose runs
# straddle page boundaries, and runs either side of the 1 MiB positioned-read threshold.
CASES = [
    ((37, 12), torch.float32, 3),
    ((64, 4096), torch.float32, 4),
    ((9, 1027), torch.bfloat16, 1),
    ((33, 3000), torch.int64, 2),
    ((5, 4099), torch.bool, 1),
    ((6, 2 * 262144 + 8), torch.float32, 2),  # 1 MiB + 16 B runs: positioned reads
    ((4, 262140), torch.float32, 1),  # one run just under 1 MiB per row
    ((3, 5, 7, 130), torch.float16, 2),
]


@pytest.mark.parametrize("shape, dtype, tp", CASES)
@pytest.mark.parametrize("min_run", [1 << 20, 1])
def test_column_shards_are_bit_exact(tmp_path, monkeypatch, shape, dtype, tp, min_run):
    # min_run=1 forces one positioned read per run, the other path, for the same slices.
    monkeypatch.setattr(load_mod, "_MIN_RUN", min_run)
    full = _random(shape, dtype, seed=len(shape) * 100 + shape[-1])
    save_checkpoint(str(tmp_path), 1, {"x": full})
    last = len(shape) - 1
    # Uneven split of the last dim (so runs start at arbitrary byte offsets within pages).
    cuts = sorted({0, shape[-1], *(shape[-1] * k // (tp + 1) + k for k in range(1, tp + 1))})
    for a, b in zip(cuts, cuts[1:]):
        local = torch.zeros((*shape[:-1], b - a), dtype=dtype)
        load_checkpoint(str(tmp_path), {"x": ShardedTensor(local, shape, (0,) * last + (a,))})
        assert torch.equal(local, full[..., a:b]), (a, b)
    # A box cut along every dim, and a flat range of a column block (strided boxes in the map).
    start = tuple(s // 3 for s in shape)
    size = tuple(max(1, s // 2) for s in shape)
    box = torch.zeros(size, dtype=dtype)
    load_checkpoint(str(tmp_path), {"x": ShardedTensor(box, shape, start)})
    assert torch.equal(box, full[tuple(slice(o, o + n) for o, n in zip(start, size))])
    block = (*shape[:-1], shape[-1] - shape[-1] // 2)
    off = (0,) * last + (shape[-1] // 2,)
    n = 1
    for s in block:
        n *= s
    lo, hi = n // 5, n - n // 7
    flat = torch.zeros(hi - lo, dtype=dtype)
    load_checkpoint(str(tmp_path), {"x": ShardedTensor(flat, shape, off, block, (lo, hi))})
    assert torch.equal(flat, full[..., shape[-1] // 2 :].reshape(-1)[lo:hi])


def test_columns_into_strided_and_wider_destinations(tmp_path):
    # Column slices into a strided (transposed) destination, and into a wider dtype (a casting copy).
    full = _random((40, 1000), torch.float32, seed=5)
    save_checkpoint(str(tmp_path), 1, {"x": full})
    for r in range(4):
        dst = torch.zeros(250, 40).t()  # a transposed view: strided destination
        load_checkpoint(str(tmp_path), {"x": ShardedTensor(dst, (40, 1000), (0, 250 * r))})
        assert torch.equal(dst, full[:, 250 * r : 250 * (r + 1)])
        wide = torch.zeros(40, 250, dtype=torch.float64)  # cast on the way
        load_checkpoint(str(tmp_path), {"x": ShardedTensor(wide, (40, 1000), (0, 250 * r))})
        assert torch.equal(wide, full[:, 250 * r : 250 * (r + 1)].double())
