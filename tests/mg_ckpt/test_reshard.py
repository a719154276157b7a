"""Save at one parallel layout, load at another; compare with the global tensors directly.

Multi-rank saves and loads run as real processes (gloo). Each rank's state is cut from fixed
global tensors by plain indexing (tests/mg_ckpt/layouts.py), so the reference does not use
mg_ckpt.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from mg_ckpt import inspect_checkpoint, load_checkpoint, save_checkpoint
from mg_parallel.testing import run_distributed
from tests.mg_ckpt.layouts import PARAMS, check_state, global_tensor, make_state


def save_at(save_dir: str, iteration: int, tp: int, dp: int, pp: int, dist_opt: bool) -> int:
    """Save the layout's state on this rank; returns how many shard files exist afterwards."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    state = make_state(rank, tp, dp, pp, dist_opt)
    extra = {"iteration": iteration, "consumed_samples": 123 * iteration, "rng": [[rank, 1, 2]]}
    save_checkpoint(save_dir, iteration, state, extra=extra, layout={"tp": tp, "dp": dp, "pp": pp, "dist_opt": dist_opt})
    return len([f for f in os.listdir(os.path.join(save_dir, f"iter_{iteration:07d}")) if f.endswith(".safetensors")])


def load_at(path: str, tp: int, dp: int, pp: int, dist_opt: bool) -> tuple[list[str], dict]:
    """Load into this rank's templates; returns (mismatched names, extra)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    template = make_state(rank, tp, dp, pp, dist_opt, empty=True)
    extra = load_checkpoint(path, template)
    return check_state(template, rank, tp, dp, pp, dist_opt), extra


def load_in_layouts(path: str, layouts: list[tuple[int, int, int, bool]]) -> list:
    """Several loads of the same checkpoint in one call (this world size's layouts)."""
    return [load_at(path, *layout) for layout in layouts]


def _assert_all_ok(results: list, iteration: int) -> None:
    for rank, per_layout in enumerate(results):
        for i, (bad, extra) in enumerate(per_layout):
            assert bad == [], f"rank {rank}, layout #{i}: wrong values for {bad}"
            assert extra["iteration"] == iteration and extra["consumed_samples"] == 123 * iteration


def test_tp2_dp2_distopt_loads_at_other_layouts(tmp_path):
    save_dir = str(tmp_path)
    files = run_distributed(save_at, 4, save_dir, 7, 2, 2, 1, True)
    # Params replicated over dp are written once; optimizer flat pieces by their owners.
    assert all(1 <= n <= 4 for n in files)
    report = inspect_checkpoint(save_dir)
    assert report.iteration == 7 and report.layout == {"tp": 2, "dp": 2, "pp": 1, "dist_opt": True}
    assert {t.name: t.shape for t in report.tensors}["layer0.proj.weight"] == (6, 12)

    # tp=1 in this process (no torch.distributed), with and without the distributed optimizer.
    _assert_all_ok([[load_at(save_dir, 1, 1, 1, True), load_at(save_dir, 1, 1, 1, False)]], 7)
    # 4 ranks: tp4; dp4 with flat ranges; tp2 x pp2; tp1 x dp2 x pp2 (optimizer not distributed).
    results = run_distributed(
        load_in_layouts, 4, save_dir, [(4, 1, 1, False), (1, 4, 1, True), (2, 1, 2, True), (1, 2, 2, False)]
    )
    _assert_all_ok(results, 7)
    results = run_distributed(load_in_layouts, 2, save_dir, [(1, 2, 1, True), (2, 1, 1, False)])
    _assert_all_ok(results, 7)


def test_dp4_flat_pieces_load_at_dp2_and_dp1(tmp_path):
    save_dir = str(tmp_path)
    run_distributed(save_at, 4, save_dir, 3, 1, 4, 1, True)
    results = run_distributed(load_in_layouts, 2, save_dir, [(1, 2, 1, True), (2, 1, 1, True)])
    _assert_all_ok(results, 3)
    _assert_all_ok([[load_at(save_dir, 1, 1, 1, True), load_at(save_dir, 1, 1, 1, False)]], 3)


def test_pipeline_and_tp4_save_loads_everywhere(tmp_path):
    # pp=2 x tp=2: each stage holds different tensors, replicated norms are elected among holders.
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    run_distributed(save_at, 4, a, 5, 2, 1, 2, False)
    run_distributed(save_at, 4, b, 9, 4, 1, 1, True)
    results = run_distributed(load_in_layouts, 4, a, [(1, 4, 1, True), (4, 1, 1, False)])
    _assert_all_ok(results, 5)
    results = run_distributed(load_in_layouts, 4, b, [(2, 2, 1, True), (1, 1, 4, False)])
    _assert_all_ok(results, 9)
    _assert_all_ok([[load_at(a, 1, 1, 1, True)]], 5)
    _assert_all_ok([[load_at(b, 1, 1, 1, False)]], 9)


def test_single_process_save_loads_at_tp2_dp2(tmp_path):
    save_dir = str(tmp_path)
    save_at(save_dir, 11, 1, 1, 1, False)
    results = run_distributed(load_in_layouts, 4, save_dir, [(2, 2, 1, True), (2, 1, 2, False)])
    _assert_all_ok(results, 11)


def test_loaded_values_match_global_tensors_in_full(tmp_path):
    # Independent of layouts.py's cutting: the whole tensors come back bit for bit at tp=1.
    run_distributed(save_at, 4, str(tmp_path), 1, 2, 2, 1, True)
    full = {name: torch.zeros(PARAMS[name][0]) for name in PARAMS}
    load_checkpoint(str(tmp_path), full, strict=True)
    for name, t in full.items():
        assert torch.equal(t, global_tensor(name)), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_dtypes_round_trip_and_cast_on_load(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    value = (torch.randn(5, 3, generator=g) * 4).to(dtype)
    save_checkpoint(str(tmp_path), 0, {"x": value, "s": torch.tensor(2, dtype=dtype)})
    out = {"x": torch.zeros(5, 3, dtype=dtype), "s": torch.zeros((), dtype=dtype)}
    load_checkpoint(str(tmp_path), out)
    assert torch.equal(out["x"], value) and out["s"].item() == torch.tensor(2, dtype=dtype).item()
    as_float = {"x": torch.zeros(5, 3, dtype=torch.float64)}
    load_checkpoint(str(tmp_path), as_float, strict=False)
    assert torch.equal(as_float["x"], value.to(torch.float64))
