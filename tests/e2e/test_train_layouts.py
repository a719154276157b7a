"""`mg train` end to end at every parallel layout, against the same run on one process.

A wiring bug that scales a gradient by a constant per parameter (a sum instead of a mean over dp,
a doubled tied-embedding gradient, a missing sequence-parallel norm reduction) leaves the loss
nearly unchanged for a few steps while AdamW hides it, so each layout is checked on three counts:
the loss and the gradient norm at every iteration, and every parameter after the last iteration
(read unsharded from the saved checkpoint: the whole state within 1e-5 relative to its norm,
every tensor within 1e-5 root mean square). Each run also reports the settings it really ran
with, so an option that is silently ignored fails here. Multi-process checkpoints resume
bit-exactly at their own layout and within 1e-5 at another.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import (
    BASE_SETTINGS,
    assert_reports_settings,
    assert_same_parameters,
    assert_same_training,
    iteration_records,
    mg,
    read_checkpoint,
    tiny_args,
)

LAYOUTS = {
    # name: (processes, --set overrides, the effective settings the run must report besides BASE_SETTINGS)
    "tp2": (2, ("parallel.tp=2",), {"tp": 2}),
    "tp2-sp-recompute": (2, ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.recompute=full"),
                         {"tp": 2, "sequence_parallel": True, "recompute": "full"}),
    "pp2": (2, ("parallel.pp=2",), {"pp": 2, "schedule": "1f1b"}),
    "recompute-selective": (1, ("parallel.recompute=selective",), {"recompute": "selective"}),  # core attention
    "dp2": (2, (), {"dp": 2, "micro_batches": 2}),
    "dp2-distopt": (2, ("parallel.distributed_optimizer=true",),
                    {"dp": 2, "micro_batches": 2, "distributed_optimizer": True}),
    "tp2-pp2": (4, ("parallel.tp=2", "parallel.pp=2"), {"tp": 2, "pp": 2, "schedule": "1f1b"}),
    "pp2-dp2-distopt": (4, ("parallel.pp=2", "parallel.distributed_optimizer=true"),
                        {"pp": 2, "dp": 2, "micro_batches": 2, "distributed_optimizer": True, "schedule": "1f1b"}),
    "pp2-vpp2": (2, ("parallel.pp=2", "parallel.vpp=2"), {"pp": 2, "vpp": 2, "schedule": "interleaved"}),
}


@pytest.fixture(scope="module")
def reference(layout_runs):
    log, ckpt, out = layout_runs.get(1)
    records = iteration_records(log)
    assert sorted(records) == list(range(1, 21)), "iterations must be logged from 1 to train.iters"
    assert records[20]["loss"] < records[1]["loss"] - 0.3, "the tiny model did not learn"
    assert_reports_settings(log, out, 1, BASE_SETTINGS)
    return records, read_checkpoint(ckpt / "iter_0000020", "model/")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, layout_runs, reference):
    nproc, sets, expected = LAYOUTS[layout]
    ref, ref_params = reference
    log, ckpt, out = layout_runs.get(nproc, sets)
    assert_reports_settings(log, out, nproc, {**BASE_SETTINGS, **expected})
    if expected.get("dp", 1) > 1:  # the paths line names how DDP's reductions (and the optimizer's gathers) run
        gathers = " param_gather=after_step" if expected.get("distributed_optimizer") else ""
        assert f"compile=off grad_reduce=overlapped{gathers}\n" in out, out[:3000]
    assert_same_training(iteration_records(log), ref, layout)
    assert_same_parameters(read_checkpoint(ckpt / "iter_0000020", "model/"), ref_params, layout)


RESUMES = {
    # saved by (processes, --set overrides of a LAYOUTS run) -> resumed at
    "tp2-pp2": (4, LAYOUTS["tp2-pp2"][1]),
    "dp2-distopt": (2, LAYOUTS["dp2-distopt"][1]),
}
TARGETS = {"same": None, "tp1-dp4": (4, ()), "pp2-dp2": (4, ("parallel.pp=2",))}


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("saved_by", list(RESUMES))
def test_multi_process_checkpoint_resumes(saved_by, target, corpus, layout_runs, tmp_path):
    """Saved at iteration 10 by a multi-process run: bit-exact at its own layout, within 1e-5 at another."""
    nproc, sets = RESUMES[saved_by]
    log, ckpt, _ = layout_runs.get(nproc, sets)
    straight = iteration_records(log)
    to_nproc, to_sets = TARGETS[target] or (nproc, sets)
    out = mg(*tiny_args(corpus, tmp_path, f"checkpoint.load={ckpt / 'iter_0000010'}", *to_sets),
             "--nproc-per-node", str(to_nproc)).stdout
    assert ", resuming at iteration 11" in out
    resumed = iteration_records(tmp_path)
    assert sorted(resumed) == list(range(11, 21))
    for it in range(11, 21):
        for key in ("loss", "grad_norm"):
            if target == "same":
                assert resumed[it][key] == straight[it][key], f"{key} at iteration {it} is not bit-exact"
            else:
                assert resumed[it][key] == pytest.approx(straight[it][key], rel=1e-5), f"{key} at iteration {it}"


def test_dropout_with_sequence_parallel_resumes_bit_exactly(corpus, layout_runs, tmp_path):
    """Dropout 0.1 at tp2 with sequence parallelism: the checkpoint restores every rank's RNG streams, so the
    resumed run draws the same masks (a reseeded run would not)."""
    sets = ("parallel.tp=2", "parallel.sequence_parallel=true", "model.dropout=0.1")
    log, ckpt, _ = layout_runs.get(2, sets)
    straight = iteration_records(log)
    no_dropout = iteration_records(layout_runs.get(2, LAYOUTS["tp2-sp-recompute"][1])[0])
    assert all(straight[it]["loss"] != no_dropout[it]["loss"] for it in straight), "dropout had no effect"
    mg(*tiny_args(corpus, tmp_path, f"checkpoint.load={ckpt / 'iter_0000010'}", *sets), "--nproc-per-node", "2")
    resumed = iteration_records(tmp_path)
    assert sorted(resumed) == list(range(11, 21))
    for it in range(11, 21):
        assert resumed[it]["loss"] == straight[it]["loss"], f"iteration {it}"
        assert resumed[it]["grad_norm"] == straight[it]["grad_norm"], f"iteration {it}"

