"""mg eval at tp2, pp2 and dp2 (2 processes, gloo) equals one process: log-likelihood metrics within 1e-6
(perplexities within 1e-6 relative),
identical greedy generations."""

from __future__ import annotations

import json

import pytest
import transformers

from mg_parallel.testing import run_distributed


def _tasks(d):
    rows = [{"context": f"Question {i}: pick", "choices": ["red", "a blue one", "green!"], "answer": i % 3}
            for i in range(7)]
    (d / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "t.jsonl").write_text("".join(json.dumps({"text": "layout parity text " * k}) + "\n" for k in (1, 4, 9)))
    (d / "s.jsonl").write_text("".join(json.dumps({"input": s, "target": "x"}) + "\n" for s in ("abc", "hello", "q")))
    return [f"choice:{d / 'mc.jsonl'}", f"perplexity:{d / 't.jsonl'}", f"seq2seq:{d / 's.jsonl'}"]


def _evaluate(model_dir, tasks, tp, pp):
    from mg_cli.evaluation.options import EvalOptions
    from mg_cli.evaluation.run import Layout, run_eval
    from mg_cli.evaluation.tasks import parse_task

    report = run_eval(model_dir, [parse_task(t) for t in tasks], EvalOptions(stride=24, max_new_tokens=5, until=()),
                      layout=Layout(tp=tp, pp=pp), batch_size=2, tokenizer_model="byte", show_progress=False)
    return report["layout"], report["results"]


def _evaluate_layouts(model_dir, tasks):
    return [_evaluate(model_dir, tasks, tp, pp) for tp, pp in ((2, 1), (1, 2), (1, 1))]


def test_tp2_pp2_dp2_equal_one_process(tmp_path):
    import torch

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=259, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=48))
    hf.save_pretrained(tmp_path / "llama")
    tasks = _tasks(tmp_path)
    _, reference = _evaluate(tmp_path / "llama", tasks, 1, 1)
    ranks = run_distributed(_evaluate_layouts, 2, tmp_path / "llama", tasks, timeout=300)
    expected_layouts = [{"tp": 2, "pp": 1, "dp": 1, "processes": 2}, {"tp": 1, "pp": 2, "dp": 1, "processes": 2},
                        {"tp": 1, "pp": 1, "dp": 2, "processes": 2}]
    for rank_results in ranks:  # every rank returns the same report
        for (layout, results), want_layout in zip(rank_results, expected_layouts):
            assert layout == want_layout
            for ours, ref in zip(results, reference):
                for name, m in ref["metrics"].items():
                    assert ours["metrics"][name]["value"] == pytest.approx(m["value"], rel=1e-6, abs=1e-6), (layout, name)
                assert ours.get("outputs") == ref.get("outputs"), layout
