"""`mg train` with fully sharded data parallelism (``parallel.fsdp``) against the same run on one process.

FSDP shards every parameter, its gradient and its AdamW state over the data-parallel ranks and gathers each
layer for its forward and backward, so the loss and the gradient norm at every iteration and every parameter
after the last one must match the one-process run (the ``layout_runs`` reference of test_train_layouts) within
1e-5: alone, with optimizer offload, under tensor and sequence parallelism with recompute, under pipeline
parallelism (a tied embedding across stages), and hybrid-sharded (dp4 as two groups of 2). Checkpoints hold the
same global tensors as without FSDP, so they resume across FSDP and non-FSDP layouts without conversion.
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
from tests.e2e.test_train_layouts import LAYOUTS as DDP_LAYOUTS
from tests.e2e.test_train_layouts import reference  # noqa: F401 - the one-process run, a fixture

FSDP = ("parallel.fsdp=true",)
LAYOUTS = {
    # name: (processes, --set overrides, the effective settings the run must report besides BASE_SETTINGS)
    "dp2-fsdp": (2, FSDP, {"dp": 2, "micro_batches": 2, "fsdp": True, "fsdp_shard_size": 2, "offload_optimizer": False}),
    "dp2-fsdp-offload": (2, (*FSDP, "parallel.offload_optimizer=true"),
                         {"dp": 2, "micro_batches": 2, "fsdp": True, "fsdp_shard_size": 2, "offload_optimizer": True}),
    "tp2-sp-recompute-dp2-fsdp": (
        4, (*FSDP, "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.recompute=full"),
        {"tp": 2, "dp": 2, "micro_batches": 2, "sequence_parallel": True, "recompute": "full", "fsdp": True,
         "fsdp_shard_size": 2, "offload_optimizer": False}),
    "pp2-dp2-fsdp": (4, (*FSDP, "parallel.pp=2"),
                     {"pp": 2, "dp": 2, "micro_batches": 2, "schedule": "1f1b", "fsdp": True, "fsdp_shard_size": 2,
                      "offload_optimizer": False}),
    "dp4-hsdp2": (4, (*FSDP, "parallel.fsdp_shard_size=2"),
                  {"dp": 4, "micro_batches": 1, "fsdp": True, "fsdp_shard_size": 2, "offload_optimizer": False}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fsdp_matches_single_process(layout, layout_runs, reference):  # noqa: F811
    nproc, sets, expected = LAYOUTS[layout]
    log, ckpt, out = layout_runs.get(nproc, sets)
    assert_reports_settings(log, out, nproc, {**BASE_SETTINGS, **expected})
    assert_same_training(iteration_records(log), reference[0], layout)
    assert_same_parameters(read_checkpoint(ckpt / "iter_0000020", "model/"), reference[1], layout)


RESUMES = {
    # case: (saved by (processes, --set overrides of a layout_runs run), resumed at (processes, --set overrides))
    "fsdp dp2 -> same": (LAYOUTS["dp2-fsdp-offload"][:2], None),
    "hsdp dp4 -> fsdp dp2": (LAYOUTS["dp4-hsdp2"][:2], (2, FSDP)),
    "hsdp dp4 -> tp2-pp2": (LAYOUTS["dp4-hsdp2"][:2], (4, DDP_LAYOUTS["tp2-pp2"][1])),
    "hsdp dp4 -> dp2 distributed optimizer": (LAYOUTS["dp4-hsdp2"][:2], DDP_LAYOUTS["dp2-distopt"][:2]),
    "one process -> fsdp dp4": ((1, ()), (4, FSDP)),
}


@pytest.mark.parametrize("case", list(RESUMES))
def test_fsdp_checkpoint_resumes(case, corpus, layout_runs, tmp_path):
    """Saved at iteration 10: bit-exact at its own layout, within 1e-5 of the run that saved it elsewhere."""
    (nproc, sets), target = RESUMES[case]
    log, ckpt, _ = layout_runs.get(nproc, sets)
    straight = iteration_records(log)
    to_nproc, to_sets = target or (nproc, sets)
    out = mg(*tiny_args(corpus, tmp_path, f"checkpoint.load={ckpt / 'iter_0000010'}", *to_sets),
             "--nproc-per-node", str(to_nproc)).stdout
    assert ", resuming at iteration 11" in out
    resumed = iteration_records(tmp_path)
    if target is None:
        for it in range(11, 21):
            for key in ("loss", "grad_norm"):
                assert resumed[it][key] == straight[it][key], f"{case}: {key} at iteration {it} is not bit-exact"
    else:
        assert_same_training(resumed, {it: straight[it] for it in range(11, 21)}, case)


@pytest.mark.parametrize(
    "nproc, sets, message",
    [
        (2, [*FSDP, "parallel.distributed_optimizer=true"],
         "parallel.fsdp and parallel.use_distributed_optimizer cannot both be true"),
        (2, [*FSDP, "parallel.fsdp_shard_size=3"], "parallel.fsdp_shard_size=3 must be a positive divisor"),
        (1, ["parallel.offload_optimizer=true"], "parallel.offload_optimizer needs parallel.fsdp: true"),
    ],
)
def test_fsdp_config_errors(corpus, tmp_path, nproc, sets, message):
    assert_config_error(corpus, tmp_path, nproc, sets, message)
