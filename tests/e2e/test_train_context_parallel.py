"""`mg train` with context parallelism (``parallel.cp``) against the same run on one process.

Each cp rank of a run reads the same samples as its cp peers and keeps its load-balanced part of every sequence;
the loss is the masked mean over whole sequences and gradients are averaged over dp x cp, so the loss and the
gradient norm at every iteration and every parameter after the last one must match the one-process run (the
``layout_runs`` reference and fixture of test_train_layouts) within 1e-5, for every cp_comm, with tensor and
sequence parallelism, with data parallelism and the distributed optimizer, with pipeline stages and full
recompute, and at cp4. A checkpoint saved at cp2 resumes at cp1 and at cp4 and continues the one-process run. Attention
dropout drops the same probabilities at cp4 (p2p) and cp2 (allgather with recompute).
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import (
    BASE_SETTINGS,
    assert_config_error,
    assert_reports_settings,
    assert_same_parameters,
    assert_same_training,
    iteration_records,
    mg,
    read_checkpoint,
    tiny_args,
)
from tests.e2e.test_train_layouts import reference  # noqa: F401 - the one-process run, a fixture

CP2 = ("parallel.cp=2",)
LAYOUTS = {
    # name: (processes, --set overrides, the effective settings the run must report besides BASE_SETTINGS)
    "cp2-p2p": (2, CP2, {"cp": 2, "cp_comm": "p2p"}),
    "cp2-allgather": (2, (*CP2, "parallel.cp_comm=allgather"), {"cp": 2, "cp_comm": "allgather"}),
    "cp2-a2a": (2, (*CP2, "parallel.cp_comm=a2a"), {"cp": 2, "cp_comm": "a2a"}),
    "cp2-tp2-sp": (4, (*CP2, "parallel.tp=2", "parallel.sequence_parallel=true"),
                   {"tp": 2, "sequence_parallel": True, "cp": 2, "cp_comm": "p2p"}),
    "cp2-dp2-distopt": (4, (*CP2, "parallel.distributed_optimizer=true"),
                        {"dp": 2, "micro_batches": 2, "distributed_optimizer": True, "cp": 2, "cp_comm": "p2p"}),
    "cp2-pp2-recompute": (4, (*CP2, "parallel.pp=2", "parallel.recompute=full"),
                          {"pp": 2, "schedule": "1f1b", "recompute": "full", "cp": 2, "cp_comm": "p2p"}),
    "cp4": (4, ("parallel.cp=4",), {"cp": 4, "cp_comm": "p2p"}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_matches_single_process(layout, layout_runs, reference):  # noqa: F811
    nproc, sets, expected = LAYOUTS[layout]
    log, ckpt, out = layout_runs.get(nproc, sets)
    assert_reports_settings(log, out, nproc, {**BASE_SETTINGS, **expected})
    assert_same_training(iteration_records(log), reference[0], layout)
    assert_same_parameters(read_checkpoint(ckpt / "iter_0000020", "model/"), reference[1], layout)


@pytest.mark.parametrize("cp", [1, 4])
def test_cp2_checkpoint_resumes_at_cp1_and_cp4(cp, corpus, layout_runs, reference, tmp_path):  # noqa: F811
    """Parameters are replicated over cp, so a cp2 checkpoint holds the one-process model: resumed at iteration 10
    on one process, or at cp4, it continues the one-process run."""
    _, ckpt, _ = layout_runs.get(2, LAYOUTS["cp2-p2p"][1])
    layout = [] if cp == 1 else [f"parallel.cp={cp}", "--nproc-per-node", str(cp)]
    out = mg(*tiny_args(corpus, tmp_path, f"checkpoint.load={ckpt / 'iter_0000010'}", *layout)).stdout
    assert ", resuming at iteration 11" in out
    assert_same_training(iteration_records(tmp_path), {it: reference[0][it] for it in range(11, 21)},
                         f"cp2 -> cp{cp}")


def test_attention_dropout_drops_the_same_probabilities_at_every_layout(corpus, layout_runs, tmp_path):
    """Attention dropout under cp keeps the probabilities a hash of their global coordinates keeps, so cp4 with
    p2p and cp2 with allgather and full recompute (which replays the masks in backward) train alike: loss and
    grad_norm at every iteration within 1e-5. The dropout takes effect: the losses differ from the run without
    it."""
    runs = {}
    for name, nproc, sets in (("cp4-p2p", 4, ("parallel.cp=4",)),
                              ("cp2-allgather-recompute", 2, (*CP2, "parallel.cp_comm=allgather",
                                                              "parallel.recompute=full"))):
        log = tmp_path / name
        mg(*tiny_args(corpus, log, *sets, "model.attention_dropout=0.2", iters=8), "--nproc-per-node", str(nproc))
        runs[name] = iteration_records(log)
    assert_same_training(runs["cp2-allgather-recompute"], runs["cp4-p2p"], "attention dropout at cp2 and cp4")
    plain = iteration_records(layout_runs.get(2, CP2)[0])
    assert all(abs(runs["cp4-p2p"][it]["loss"] - plain[it]["loss"]) > 1e-4 for it in range(1, 9)), \
        "attention dropout had no effect"


@pytest.mark.parametrize(
    "nproc, sets, message",
    [
        (2, [*CP2, "model.seq_length=30"], "model.seq_length=30 is not divisible by 2 * parallel.cp = 4"),
        (2, [*CP2, "model.type=bert", "model.preset=tiny-bert"],
         "context parallelism is only supported for model.type=gpt"),
        (2, [*CP2, "parallel.cp_comm=a2a", "model.num_attention_heads=1"], "parallel.cp_comm=a2a splits"),
        (2, [*CP2, "parallel.cp_comm=a2a", "model.attention_dropout=0.1"],
         "model.attention_dropout=0.1 is not supported with parallel.cp_comm=a2a"),
        (2, [*CP2, "parallel.cp_comm=ring"], "parallel.cp_comm"),
    ],
)
def test_context_parallel_config_errors(corpus, tmp_path, nproc, sets, message):
    assert_config_error(corpus, tmp_path, nproc, sets, message)
