"""`train.compile`: each transformer layer compiled (regional compilation) trains as the eager run does, at tp1 and
at tp2 with sequence parallelism and full recompute (fp32, loss and grad_norm at every iteration within 1e-5, the
final parameters too); the start line names the compiled layers and the compile time is logged apart from the
step time."""

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
    read_metrics,
    tiny_args,
)

CASES = {  # name: (processes, --set overrides of the eager run it is compared with, its effective settings)
    "tp1": (1, (), {}),
    "tp2-sp-recompute": (2, ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.recompute=full"),
                         {"tp": 2, "sequence_parallel": True, "recompute": "full"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_layers_train_as_eager(case, corpus, layout_runs, tmp_path):
    nproc, sets, expected = CASES[case]
    ref_log, ref_ckpt, _ = layout_runs.get(nproc, sets)  # the eager run of the layout tests
    args = tiny_args(corpus, tmp_path / "log", f"checkpoint.save={tmp_path / 'ckpt'}", "checkpoint.interval=10",
                     *sets, "train.compile=true")
    out = mg(*args, *(["--nproc-per-node", str(nproc)] if nproc > 1 else [])).stdout
    assert_reports_settings(tmp_path / "log", out, nproc, {**BASE_SETTINGS, **expected, "compiled_layers": 4})
    # The kernels the step picks on this CPU (fused AdamW, SDPA's flash kernel for plain causal attention) and the
    # compiled layers, named in the start output and the start record.
    paths = {"adamw": "fused", "attention": "sdpa:flash", "norm": "F.layer_norm", "compile": "4 layers"}
    assert "paths: adamw=fused attention=sdpa:flash norm=F.layer_norm compile=4 layers" in out, out[:3000]
    assert read_metrics(tmp_path / "log")[0]["paths"] == paths
    records = iteration_records(tmp_path / "log")
    assert_same_training(records, iteration_records(ref_log), f"compiled {case}")
    assert_same_parameters(read_checkpoint(tmp_path / "ckpt" / "iter_0000020", "model/"),
                           read_checkpoint(ref_ckpt / "iter_0000020", "model/"), f"compiled {case}")
    first = records[1]
    # The first step compiled the layers' forward and backward: seconds, logged apart and left out of its time.
    assert first["compile_s"] > 1.0 and first["step_time_s"] < 0.5 * first["compile_s"], first
    assert "s compiling (train.compile), left out of its step time and tokens/s" in out
    assert all("compile_s" not in records[i] for i in range(3, 21)), "the identical later steps recompiled"
