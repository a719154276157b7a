"""`mg train` failure paths: one-line config errors, a killed rank, fp16 overflow skips, non-finite loss."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.e2e.conftest import mg, mg_start, read_metrics, tiny_args, train_losses


@pytest.mark.parametrize(
    "nproc, sets, message",
    [
        (1, ["parallel.tp=2"], "1 processes are not divisible by parallel.tp*parallel.pp = 2*1 = 2"),
        (2, ["parallel.tp=2", "model.num_attention_heads=3", "model.hidden_size=66"],
         "model.num_attention_heads=3 is not divisible by parallel.tp=2"),
        (1, ["train.global_batch_size=6", "train.micro_batch_size=4"], "train.global_batch_size=6 is not divisible"),
        (2, ["parallel.pp=2", "model.num_layers=3"], "model.num_layers"),
        (1, ["data.path=/nonexistent/prefix"], "data.path: /nonexistent/prefix.bin/.idx not found"),
        (1, ["data.tokenizer_model=/nonexistent.model"], "data.tokenizer_model: /nonexistent.model does not exist"),
        (1, ["optim.lrr=1"], "unknown key 'optim.lrr'; did you mean 'optim.lr'?"),
        (1, ["model.preset=gpt-9000"], "model.preset='gpt-9000' is unknown"),
        (1, ["checkpoint.load=/nonexistent/ckpt"], "checkpoint.load: /nonexistent/ckpt does not exist"),
        (1, ["parallel.sequence_parallel=true"], "parallel.sequence_parallel needs parallel.tp > 1; set it to false or raise tp"),
    ],
)
def test_config_errors_are_one_line(corpus, tmp_path, nproc, sets, message):
    # In-process (the checks run before any worker starts); the exit code and message are the CLI's.
    from click.testing import CliRunner

    from mg_cli.main import cli

    args = tiny_args(corpus, tmp_path, *sets)
    if nproc > 1:
        args += ["--nproc-per-node", str(nproc)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[-1].startswith("Error: ") and message in lines[-1], result.output[-3000:]


def test_corrupt_dataset_is_named(corpus, tmp_path):
    bad = tmp_path / "bad_text_document"
    (tmp_path / "bad_text_document.idx").write_bytes(b"NOTANIDX" + b"\0" * 40)
    (tmp_path / "bad_text_document.bin").write_bytes(b"\0" * 16)
    proc = mg(*tiny_args(corpus, tmp_path / "log", f"data.path={bad}"), check=False)
    assert proc.returncode == 1
    assert "bad_text_document.idx" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_killed_rank_ends_the_job_nonzero(corpus, tmp_path):
    """A rank killed mid-run ends the job non-zero in one line naming it; the other rank, whose collective fails,
    prints nothing of its own failure."""
    args = tiny_args(corpus, tmp_path, iters=100000) + ["--nproc-per-node", "2"]
    proc = mg_start(*args, stdout=os.devnull, stderr=tmp_path / "stderr.txt")
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not ((tmp_path / "metrics.jsonl").exists() and read_metrics(tmp_path)):
            time.sleep(0.5)
        assert read_metrics(tmp_path), "training never started"
        # The workers are the launcher's grandchildren running `mg_cli.main train` with LOCAL_RANK set.
        victim = _worker_pid(proc.pid, local_rank="1")
        os.kill(victim, signal.SIGKILL)
        start = time.monotonic()
        code = proc.wait(timeout=180)
        assert code != 0
        assert time.monotonic() - start < 120
        err = proc.read_stderr()
        lines = [line for line in err.splitlines() if line.strip()]
        assert lines[-1] == f"Error: rank 1 (pid {victim}) was killed by SIGKILL", err[-3000:]
        assert "Traceback" not in err and "FAILED" not in err, err[-3000:]
    finally:
        # The launcher starts workers in sessions of their own: stop every descendant, not just its group.
        for pid in _descendants(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _descendants(root: int) -> list[int]:
    parent: dict[int, int] = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                stat = open(f"/proc/{pid}/stat").read()
                parent[int(pid)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, frontier = [], [root]
    while frontier:
        cur = frontier.pop()
        kids = [p for p, pp in parent.items() if pp == cur]
        out += kids
        frontier += kids
    return out


def _worker_pid(launcher: int, local_rank: str) -> int:
    """The training worker with ``LOCAL_RANK=local_rank`` among the launcher's descendants."""
    for pid in _descendants(launcher):
        try:
            name = open(f"/proc/{pid}/comm").read().strip()
        except OSError:
            continue
        if name == f"mg-rank{local_rank}":  # one node: the global rank is the local one
            return pid
    raise AssertionError(f"no worker with LOCAL_RANK={local_rank} under process {launcher}")


def test_fp16_overflow_skips_steps_and_backs_off(corpus, tmp_path):
    # A start scale of 2^40 overflows fp16 gradients: those steps must be skipped, the scale halved.
    mg(*tiny_args(corpus, tmp_path, "train.precision=fp16", "train.initial_loss_scale=1099511627776",
                  "model.num_layers=2", iters=6))
    rows = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert rows[0]["skipped"] is True
    scales = [r["loss_scale"] for r in rows]
    assert scales[1] < scales[0] or scales[2] < scales[0], scales
    assert all(r["loss"] is not None for r in rows)


def test_nonfinite_loss_stops_with_iteration(corpus, tmp_path):
    proc = mg(*tiny_args(corpus, tmp_path, "optim.lr=1e30", "optim.warmup_iters=0", "optim.clip_grad=0",
                         "optim.decay_style=constant", f"checkpoint.save={tmp_path / 'ckpt'}", iters=30), check=False)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "at iteration" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "ckpt" / "latest").exists()


def test_two_nodes_on_one_machine(corpus, tmp_path):
    """Two launchers with --nnodes 2 form one dp=2 job; its losses equal a single-node dp=2 run."""
    port = str(29000 + os.getpid() % 1000)
    procs = []
    for node in (0, 1):
        args = tiny_args(corpus, tmp_path / f"node{node}", iters=6) + [
            "--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", port]
        procs.append(mg_start(*args, stdout=tmp_path / f"node{node}.txt"))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    assert "mg train: 2 processes, tp=1 pp=1 dp=2" in outs[0]
    single = tmp_path / "single"
    mg(*tiny_args(corpus, single, iters=6), "--nproc-per-node", "2")
    two_node, one_node = train_losses(tmp_path / "node0"), train_losses(single)
    assert sorted(two_node) == list(range(1, 7))
    for it in one_node:
        assert two_node[it] == pytest.approx(one_node[it], rel=1e-6)
