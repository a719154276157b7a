"""mg eval on a checkpoint mg train wrote, as users run it: one process, and tp2 on two processes with the
same scores (within 1e-6) and the same greedy outputs, an lm-evaluation-harness task YAML included; a table on
the terminal and a JSON report; with --set train.precision=bf16, perplexity within bf16's rounding."""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import mg


def test_eval_checkpoint_one_process_and_tp2(corpus, layout_runs, tmp_path):
    _, ckpt, _ = layout_runs.get(1)
    texts = [json.loads(line)["text"][:400] for line in corpus["jsonl"].read_text().splitlines()[:3]]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    contexts = ["def main(", "print(", "if x =="]
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps({"context": c, "choices": [")", "self):", "x"],
                                                           "answer": i % 3}) + "\n" for i, c in enumerate(contexts)))
    (tmp_path / "s.jsonl").write_text(json.dumps({"input": "import os\n", "target": "import sys"}) + "\n")
    (tmp_path / "mc.yaml").write_text(json.dumps({  # JSON is YAML
        "task": "mg_e2e_mc", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(tmp_path / "mc.jsonl")}},
        "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{context}}",
        "doc_to_choice": "{{choices}}", "doc_to_target": "answer", "metric_list": [{"metric": "acc_norm"}]}))
    args = ["eval", "--checkpoint", str(ckpt), "--task", f"perplexity:{tmp_path / 't.jsonl'}",
            "--task", f"perplexity:{corpus['prefix']}", "--task", f"choice:{tmp_path / 'mc.jsonl'}",
            "--task", f"seq2seq:{tmp_path / 's.jsonl'}", "--harness-task", str(tmp_path / "mc.yaml"),
            "--limit", "3", "--stride", "16", "--max-new-tokens", "8"]
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf")}
    one = mg(*args, "--json", str(tmp_path / "one.json"), env=env)
    assert "bits_per_byte" in one.stdout and "acc_norm" in one.stdout and "harness/mg_e2e_mc" in one.stdout, one.stdout
    tp2 = mg(*args, "--json", str(tmp_path / "tp2.json"), "--set", "parallel.tp=2", "--nproc-per-node", "2", env=env)
    assert "tp=2 pp=1 dp=1 (2 processes)" in tp2.stdout, tp2.stdout
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "tp2"))
    assert a["results"][1]["num_examples"] == 3 and a["results"][1]["tokens"] > 0
    # the harness's acc_norm over the same three questions is mg's own choice task's
    assert a["results"][4]["task"] == "harness/mg_e2e_mc" and a["results"][4]["num_examples"] == 3
    assert a["results"][4]["metrics"]["acc_norm"]["value"] == pytest.approx(a["results"][2]["metrics"]["acc_norm"]["value"])
    assert len(b["results"]) == len(a["results"])
    for ra, rb in zip(a["results"], b["results"]):
        for name, m in ra["metrics"].items():
            assert rb["metrics"][name]["value"] == pytest.approx(m["value"], rel=1e-6, abs=1e-6), (ra["task"], name)
        assert ra.get("outputs") == rb.get("outputs")
    # train.precision as mg train has it: the checkpoint scored in bf16, within bf16's rounding of fp32
    bf16 = mg("eval", "--checkpoint", str(ckpt), "--task", f"perplexity:{tmp_path / 't.jsonl'}", "--limit", "3",
              "--stride", "16", "--set", "train.precision=bf16", "--json", str(tmp_path / "bf16.json"))
    assert "(1 processes), bf16, " in bf16.stdout, bf16.stdout
    c = json.loads((tmp_path / "bf16.json").read_text())
    assert c["precision"] == "bf16" and a["precision"] == "fp32"
    nll = c["results"][0]["metrics"]["nll_per_token"]["value"]
    assert nll == pytest.approx(a["results"][0]["metrics"]["nll_per_token"]["value"], rel=2e-2)


def test_eval_tasks_in_the_training_loop(corpus, tmp_path):
    """eval.tasks at tp2 (two processes) logs eval/<task>/<metric> at every evaluation, equal (1e-6) to what
    `mg eval` on one process reports for the checkpoint of the same iteration (at the training context length,
    --max-length model.seq_length); `mg plot` draws them."""
    from tests.e2e.conftest import read_metrics, tiny_args

    texts = [json.loads(line)["text"][:300] for line in corpus["jsonl"].read_text().splitlines()[:3]]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps({"context": "def main(", "choices": [")", "self):", "x"],
                                                           "answer": i % 3}) + "\n" for i in range(4)))
    tasks = f"eval.tasks=[ppl=perplexity:{tmp_path / 't.jsonl'}, mc=choice:{tmp_path / 'mc.jsonl'}]"
    log = tmp_path / "log"
    mg(*tiny_args(corpus, log, tasks, "parallel.tp=2", "eval.interval=2", f"checkpoint.save={tmp_path / 'ckpt'}",
                  "checkpoint.interval=2", iters=4), "--nproc-per-node", "2")
    records = {r["iteration"]: r for r in read_metrics(log) if "eval/ppl/nll_per_token" in r}
    assert sorted(records) == [2, 4]
    mg("eval", "--checkpoint", str(tmp_path / "ckpt" / "iter_0000004"), "--task", f"ppl=perplexity:{tmp_path / 't.jsonl'}",
       "--task", f"mc=choice:{tmp_path / 'mc.jsonl'}", "--max-length", "32", "--json", str(tmp_path / "eval.json"))
    offline = json.loads((tmp_path / "eval.json").read_text())["results"]
    for result in offline:
        for name, m in result["metrics"].items():
            assert records[4][f"eval/{result['task']}/{name}"] == pytest.approx(m["value"], rel=1e-6), name
    mg("plot", str(log), "-o", str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").stat().st_size > 10_000
