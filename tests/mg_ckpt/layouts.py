"""A small model-like state described at a given (tp, dp, pp, distributed optimizer) layout.

The global tensors are generated from fixed seeds, independently of the layout; a rank's state
is cut from them with plain indexing (not with mg_ckpt), so loads can be compared with the
global tensors directly.
"""

from __future__ import annotations

import math

import torch

from mg_ckpt import ShardedTensor

# name -> (global shape, tensor-parallel split dim or None for replicated)
PARAMS: dict[str, tuple[tuple[int, ...], int | None]] = {
    "embedding.weight": ((16, 6), 0),
    "layer0.qkv.weight": ((12, 6), 0),
    "layer0.qkv.bias": ((12,), 0),
    "layer0.proj.weight": ((6, 12), 1),
    "layer0.norm.weight": ((6,), None),
    "layer1.conv.weight": ((4, 8, 3), 1),
    "layer1.scale": ((), None),
    "final_norm.bias": ((6,), None),
}


def global_tensor(name: str, kind: str = "param") -> torch.Tensor:
    """The global value of ``name`` (``kind`` picks independent data for optimizer states)."""
    shape, _ = PARAMS[name]
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(f"{kind}/{name}")) % (2**31)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)


def stage_of(name: str, pp: int) -> int:
    """The pipeline stage holding ``name``: parameters are spread over stages by position."""
    return list(PARAMS).index(name) * pp // len(PARAMS)


def coords(rank: int, tp: int, dp: int) -> tuple[int, int, int]:
    """(tp_rank, dp_rank, pp_rank) of ``rank`` (tp fastest, then dp, then pp)."""
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


def _block(name: str, tp_rank: int, tp: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    shape, dim = PARAMS[name]
    if dim is None:
        return (0,) * len(shape), shape
    size = shape[dim] // tp
    offset = [0] * len(shape)
    offset[dim] = tp_rank * size
    local = list(shape)
    local[dim] = size
    return tuple(offset), tuple(local)


def _cut(t: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(offset, shape))].clone()


def _dp_ranges(names: list[str], tp_rank: int, tp: int, dp_rank: int, dp: int) -> dict[str, tuple[int, int]]:
    # As a distributed optimizer does: concatenate the stage's tp blocks into one flat buffer,
    # cut it into dp equal parts (padded), and give each parameter its overlap with this rank's part.
    sizes = [math.prod(_block(n, tp_rank, tp)[1]) for n in names]
    total = sum(sizes)
    part = -(-total // dp)
    lo, hi = dp_rank * part, min((dp_rank + 1) * part, total)
    out, start = {}, 0
    for n, s in zip(names, sizes):
        a, b = max(lo, start), min(hi, start + s)
        if a < b:
            out[n] = (a - start, b - start)
        start += s
    return out


def make_state(rank: int, tp: int, dp: int, pp: int, dist_opt: bool, *, empty: bool = False) -> dict:
    """This rank's state: params (tp blocks, replicated over dp) and an Adam-like ``exp_avg`` per param.

    With ``dist_opt`` the optimizer state is a flat range of each tp block, split over dp;
    otherwise it is the tp block itself, replicated over dp. ``empty`` gives zero-filled
    templates of the same description, for loading.
    """
    tp_rank, dp_rank, pp_rank = coords(rank, tp, dp)
    names = [n for n in PARAMS if stage_of(n, pp) == pp_rank]
    state: dict = {}
    for name in names:
        shape, dim = PARAMS[name]
        offset, local = _block(name, tp_rank, tp)
        value = torch.zeros(local) if empty else _cut(global_tensor(name), offset, local)
        if dim is None:
            state[name] = value  # replicated plain tensor
        else:
            state[name] = ShardedTensor(value, shape, offset, replica_rank=dp_rank, num_replicas=dp)
    ranges = _dp_ranges(names, tp_rank, tp, dp_rank, dp) if dist_opt else {}
    for name in names:
        shape, dim = PARAMS[name]
        offset, local = _block(name, tp_rank, tp)
        reps = tp if dim is None else 1
        rep_rank = tp_rank if dim is None else 0
        if dist_opt:
            if name not in ranges:
                continue
            a, b = ranges[name]
            full = _cut(global_tensor(name, "exp_avg"), offset, local).reshape(-1)
            value = torch.zeros(b - a) if empty else full[a:b].clone()
            state[f"optimizer.exp_avg.{name}"] = ShardedTensor(value, shape, offset, local, (a, b), rep_rank, reps)
        else:
            value = torch.zeros(local) if empty else _cut(global_tensor(name, "exp_avg"), offset, local)
            state[f"optimizer.exp_avg.{name}"] = ShardedTensor(
                value, shape, offset, replica_rank=rep_rank * dp + dp_rank, num_replicas=reps * dp
            )
    return state


def check_state(state: dict, rank: int, tp: int, dp: int, pp: int, dist_opt: bool) -> list[str]:
    """Names whose loaded values differ from the expected slices of the global tensors."""
    expected = make_state(rank, tp, dp, pp, dist_opt)
    if set(expected) != set(state):
        return [f"key sets differ: {sorted(set(expected) ^ set(state))}"]
    bad = []
    for name, want in expected.items():
        got = state[name]
        w = want.local if isinstance(want, ShardedTensor) else want
        g = got.local if isinstance(got, ShardedTensor) else got
        if not torch.equal(w, g):
            bad.append(name)
    return bad
