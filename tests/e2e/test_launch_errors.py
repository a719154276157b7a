"""Errors found inside the workers of a launched job (`--nproc-per-node 2`): every rank stops on the same error, and
the job's stderr ends with its one line, printed once, with no launcher failure report and no traceback."""

from __future__ import annotations

import json
import subprocess

from tests.e2e.conftest import mg, tiny_args

LAUNCHER_REPORT = ("Traceback", "FAILED", "ChildFailedError", "ProcessExitedException", "_forked_worker",
                   "torch/distributed")
"""What torch's elastic launcher prints when a worker fails (its log line with a traceback, then its report)."""


def assert_ends_in_one_error(proc: subprocess.CompletedProcess, message: str) -> None:
    """``proc`` exited 1, its stderr's last line is ``Error: ...`` holding ``message``, and that is the only
    ``Error:`` line of the job, with nothing of the launcher's failure report."""
    out = f"stdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 1, out
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("Error: ") and message in lines[-1], out
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "Error:" in line]
    assert errors == [lines[-1]], out
    assert not [m for m in LAUNCHER_REPORT if m in proc.stderr], out


def test_data_error_found_by_the_workers(corpus, tmp_path):
    """SFT conversations longer than model.seq_length + 1 under data.on_long=error: found when each rank builds its
    dataset."""
    from mg_data import PreprocessConfig, run_preprocess

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"prompt": f"Repeat {i}.", "completion": " ".join([str(i)] * 40)}) + "\n"
                             for i in range(16)))
    run_preprocess(PreprocessConfig(input=[str(chats)], output_prefix=str(tmp_path / "chats"),
                                    tokenizer_model=str(corpus["tokenizer"]), format="sft"))
    proc = mg(*tiny_args(corpus, tmp_path / "log", "data.format=sft", f"data.path={tmp_path / 'chats'}",
                         "data.on_long=error", iters=2), "--nproc-per-node", "2", check=False)
    assert_ends_in_one_error(proc, "more than seq_length + 1 = 33")


def test_config_error_found_by_the_workers(corpus, layout_runs, tmp_path):
    """model.num_layers=6 with checkpoint.load of the 4-layer tiny model: found when each rank loads its model."""
    _, ckpt, _ = layout_runs.get(1)
    proc = mg(*tiny_args(corpus, tmp_path, "model.num_layers=6", f"checkpoint.load={ckpt}", iters=2),
              "--nproc-per-node", "2", check=False)
    assert_ends_in_one_error(proc, "checkpoint.load: ")
    assert "decoder.layers.4." in proc.stderr and "are not in the checkpoint" in proc.stderr


def test_eval_error_found_by_the_workers(tmp_path):
    """`mg eval` launches through the same launcher: a checkpoint that is not there, found by each rank."""
    task = tmp_path / "t.jsonl"
    task.write_text(json.dumps({"text": "hello world"}) + "\n")
    proc = mg("eval", "--checkpoint", str(tmp_path / "missing"), "--task", f"perplexity:{task}", "--nproc-per-node",
              "2", check=False)
    assert_ends_in_one_error(proc, f"{tmp_path / 'missing'}")
