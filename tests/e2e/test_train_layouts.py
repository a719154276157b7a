"""`mg train` end to end: the same run at every parallel layout gives the same losses."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import mg, tiny_args, train_losses

LAYOUTS = {
    # name: (processes, --set overrides, the layout line `mg train` must print)
    "tp2": (2, ["parallel.tp=2"], "tp=2 pp=1 dp=1"),
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"], "tp=2 pp=1 dp=1"),
    "pp2": (2, ["parallel.pp=2"], "tp=1 pp=2 dp=1"),
    "dp2": (2, [], "tp=1 pp=1 dp=2"),
    "tp2-pp2": (4, ["parallel.tp=2", "parallel.pp=2"], "tp=2 pp=2 dp=1"),
    "pp2-dp2-distopt": (4, ["parallel.pp=2", "parallel.distributed_optimizer=true"], "tp=1 pp=2 dp=2"),
    "pp2-vpp2": (2, ["parallel.pp=2", "parallel.vpp=2"], "tp=1 pp=2 dp=1"),
}


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> dict[int, float]:
    log = tmp_path_factory.mktemp("ref")
    mg(*tiny_args(corpus, log))
    losses = train_losses(log)
    assert sorted(losses) == list(range(1, 21)), "iterations must be logged from 1 to train.iters"
    assert losses[20] < losses[1] - 0.3, f"the tiny model did not learn: {losses[1]} -> {losses[20]}"
    return losses


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, corpus, reference, tmp_path):
    nproc, sets, line = LAYOUTS[layout]
    out = mg(*tiny_args(corpus, tmp_path, *sets), "--nproc-per-node", str(nproc)).stdout
    assert f"mg train: {nproc} processes, {line}" in out, out[-2000:]
    losses = train_losses(tmp_path)
    assert sorted(losses) == sorted(reference)
    for it, ref in reference.items():
        assert losses[it] == pytest.approx(ref, rel=1e-5), f"{layout}: iteration {it}: {losses[it]} vs {ref}"
