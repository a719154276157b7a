"""The lm-evaluation-harness adapter on mg models against the harness's own ``hf`` backend on the same
Hugging Face directory: identical acc, acc_norm and perplexities (local task YAMLs over JSONL files,
nothing downloaded) and identical greedy generations, for a small random GPT-2 and Llama. Task YAMLs
through the harness's loader (include, groups, ``!function`` only with the flag, broken files in one line),
and a harness group at dp2 equal to one process on both ranks."""

from __future__ import annotations

import json

import lm_eval
import pytest
import tokenizers
import transformers

CORPUS = ["the cat sat on the mat", "a dog ran in the park", "red green blue yellow", "one two three four five",
          "question answer choice"] * 4


def _tokenizer(d):
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<unk>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                                unk_token="<unk>")
    fast.save_pretrained(d)
    return fast


def _model(kind, vocab):
    import torch

    torch.manual_seed(3)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0))


TASKS = {
    "mc": ("multiple_choice", {"doc_to_text": "{{context}}", "doc_to_choice": "{{choices}}", "doc_to_target": "answer",
                               "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}),
    "ppl": ("loglikelihood_rolling", {"doc_to_text": "", "doc_to_target": "{{text}}",
                                      "metric_list": [{"metric": "word_perplexity"}, {"metric": "bits_per_byte"}]}),
}


def _task_dir(d):
    rows = [{"context": f"question {i}:", "choices": ["red green", "the cat", "two", "a dog ran"], "answer": i % 4}
            for i in range(6)]
    (d / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "ppl.jsonl").write_text("".join(json.dumps({"text": " ".join(CORPUS[i:i + 9])}) + "\n" for i in range(4)))
    for name, (output_type, extra) in TASKS.items():
        cfg = {"task": f"mg_toy_{name}", "dataset_path": "json",
               "dataset_kwargs": {"data_files": {"test": str(d / f"{name}.jsonl")}}, "test_split": "test",
               "output_type": output_type, **extra}
        (d / f"{name}.yaml").write_text(json.dumps(cfg))  # JSON is YAML
    return d


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def setup(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    fast = _tokenizer(d)
    _model(request.param, len(fast)).save_pretrained(d)
    return d, _task_dir(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _simple(model, tasks_dir, **kw):
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, tasks=[f"mg_toy_{n}" for n in TASKS], bootstrap_iters=0,
                                  task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False), **kw)
    return {t: {k: v for k, v in r.items() if k != "alias"} for t, r in out["results"].items()}


def test_adapter_scores_equal_hf_backend(setup):
    from mg_cli.evaluation.harness import MgLM

    model_dir, tasks_dir = setup
    ours = _simple(MgLM.from_checkpoint(model_dir, batch_size=2), tasks_dir)
    theirs = _simple("hf", tasks_dir, model_args=f"pretrained={model_dir},dtype=float32", device="cpu", batch_size=2)
    assert ours.keys() == theirs.keys()
    for task, metrics in theirs.items():
        for key, value in metrics.items():
            if isinstance(value, float):
                assert ours[task][key] == pytest.approx(value, rel=1e-5), (task, key)  # printed precision: 4 places
            elif isinstance(value, (int, str)):
                assert ours[task][key] == value, (task, key)


def test_adapter_greedy_generations_equal_hf_backend(setup):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from mg_cli.evaluation.harness import MgLM

    model_dir, _ = setup
    kwargs = {"until": ["\n"], "max_gen_toks": 7, "do_sample": False}
    reqs = [Instance("generate_until", {}, (c, kwargs), i) for i, c in enumerate(["the cat", "one two", "red"])]
    ours = MgLM.from_checkpoint(model_dir, batch_size=2)
    theirs = HFLM(pretrained=str(model_dir), dtype="float32", device="cpu", batch_size=2)
    assert ours.generate_until(reqs) == theirs.generate_until(reqs)
    ll = [Instance("loglikelihood", {}, (c, " the cat"), i) for i, c in enumerate(["", "question 1:", "dog "])]
    for (a, ga), (b, gb) in zip(ours.loglikelihood(ll), theirs.loglikelihood(ll)):
        assert a == pytest.approx(b, abs=1e-5) and ga == gb


# -- task YAMLs: lm-eval's loader (include, !function, groups), checked before anything runs -------------------------

BASE = """dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
"""

FILES = {
    "mc.yaml": "include: base.yaml\ntask: mg_inc_mc\n",
    "fn.yaml": "include: base.yaml\ntask: mg_inc_fn\nprocess_docs: !function utils.first_three\n",
    "utils.py": "open(__file__ + '.imported', 'w').close()\n\ndef first_three(docs):\n    return docs.select(range(3))\n",
    "group.yaml": "group: mg_inc_group\ntask: [mg_inc_mc, mg_inc_fn]\naggregate_metric_list:\n  - metric: acc\n",
    "ppl.yaml": "task: mg_inc_ppl\ndataset_path: json\ndataset_kwargs: {{data_files: {{test: {ppl}}}}}\ntest_split: test\n"
                "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{{{text}}}}'\n"
                "metric_list: [{{metric: word_perplexity}}, {{metric: bits_per_byte}}]\n",
    "gen.yaml": "task: mg_inc_gen\ndataset_path: json\ndataset_kwargs: {{data_files: {{test: {gen}}}}}\ntest_split: test\n"
                "output_type: generate_until\ndoc_to_text: '{{{{input}}}}'\ndoc_to_target: '{{{{target}}}}'\n"
                "generation_kwargs: {{until: ['\\n'], max_gen_toks: 6, do_sample: false}}\n"
                "metric_list: [{{metric: exact_match}}]\n",
    "dp.yaml": "group: mg_inc_dp\ntask: [mg_inc_mc, mg_inc_ppl, mg_inc_gen]\n",
    "malformed.yaml": "task: mg_bad\ndoc_to_text: [unclosed\n",
    "taskless.yaml": "include: base.yaml\n",
    "missing_include.yaml": "include: nowhere.yaml\ntask: mg_missing\n",
}


@pytest.fixture(scope="module")
def yaml_tasks(tmp_path_factory):
    """A GPT-2 directory and a task folder: a base config, a task including it, a task with a ``!function``
    (its utils.py leaves a marker file when imported), a group of both, and broken files."""
    model_dir = tmp_path_factory.mktemp("gpt2_yaml")
    _model("gpt2", len(_tokenizer(model_dir))).save_pretrained(model_dir)
    d = tmp_path_factory.mktemp("yaml_tasks")
    rows = [{"context": f"question {i}:", "choices": ["red green", "the cat", "two", "a dog ran"], "answer": i % 4}
            for i in range(7)]  # odd: two data-parallel ranks take 4 and 3
    (d / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "ppl.jsonl").write_text("".join(json.dumps({"text": " ".join(CORPUS[i:i + 7])}) + "\n" for i in range(5)))
    (d / "gen.jsonl").write_text("".join(json.dumps({"input": c[:9], "target": c[9:]}) + "\n" for c in CORPUS[:5]))
    (d / "base.yaml").write_text(BASE.format(data=d / "mc.jsonl"))
    for name, text in FILES.items():
        (d / name).write_text(text.format(ppl=d / "ppl.jsonl", gen=d / "gen.jsonl") if "{" in text else text)
    return model_dir, d


def test_task_yamls_load_with_the_harness_loader_and_python_needs_the_flag(yaml_tasks):
    from mg_cli.evaluation.harness import MgLM, run_harness_tasks

    model_dir, d = yaml_tasks
    scorer = MgLM.from_checkpoint(model_dir, batch_size=2).scorer
    marker = d / "utils.py.imported"
    for refused in ("fn.yaml", "group.yaml"):  # the !function task, and the group it is a member of
        with pytest.raises(ValueError) as e:
            run_harness_tasks(scorer, [str(d / refused)], limit=3)
        assert "\n" not in str(e.value) and str(d / "fn.yaml") in str(e.value), str(e.value)
        assert "!function utils.first_three" in str(e.value) and "--allow-code-execution" in str(e.value)
    assert not marker.exists(), "utils.py was imported without --allow-code-execution"

    (plain,) = run_harness_tasks(scorer, [str(d / "mc.yaml")], limit=3)  # include: base.yaml, no Python
    assert plain["task"] == "harness/mg_inc_mc" and plain["num_examples"] == 3
    grouped = {r["task"]: r for r in run_harness_tasks(scorer, [str(d / "group.yaml")], allow_code_execution=True)}
    assert marker.exists()
    assert set(grouped) == {"harness/mg_inc_mc", "harness/mg_inc_fn", "harness/mg_inc_group"}
    fn, mc = grouped["harness/mg_inc_fn"], grouped["harness/mg_inc_mc"]
    # process_docs kept the first three documents: the same scores as the plain task limited to three
    assert fn["num_examples"] == 3 and mc["num_examples"] == 7 and grouped["harness/mg_inc_group"]["num_examples"] == 10
    for name in ("acc", "acc_norm"):
        assert fn["metrics"][name]["value"] == pytest.approx(plain["metrics"][name]["value"], abs=1e-12), name


@pytest.mark.parametrize("name, message", [
    ("malformed.yaml", "malformed YAML ("),
    ("taskless.yaml", "no task: key"),
    ("missing_include.yaml", "nowhere.yaml (in an include:)"),
    ("fn.yaml", "!function utils.first_three runs Python"),
    ("absent.yaml", "no such file"),
])
def test_cli_task_file_errors_are_one_line(yaml_tasks, name, message):
    from click.testing import CliRunner

    from mg_cli.main import cli

    _, d = yaml_tasks
    out = CliRunner().invoke(cli, ["eval", "--checkpoint", str(d), "--harness-task", str(d / name)])
    lines = out.output.splitlines()
    assert out.exit_code == 1 and len(lines) == 1 and lines[0].startswith("Error: "), out.output
    assert name in lines[0] and message in lines[0], lines[0]
    if name == "malformed.yaml":
        assert "at line 3, column 1)" in lines[0]
    if name == "fn.yaml":
        assert "--allow-code-execution" in lines[0]


def _harness_report(model_dir, task_file):
    import os

    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    from mg_cli.evaluation.run import run_eval

    report = run_eval(model_dir, [], harness_tasks=[str(task_file)], batch_size=2, show_progress=False)
    return report["layout"], report["results"]


def test_harness_task_at_dp2_equals_one_process(yaml_tasks):
    """A group of a multiple-choice, a rolling-perplexity and a greedy-generation task at dp2 (2 processes,
    gloo): both ranks return the one-process metrics and example counts (an odd number of documents)."""
    from mg_parallel.testing import run_distributed

    model_dir, d = yaml_tasks
    _, reference = _harness_report(model_dir, d / "dp.yaml")
    assert {r["task"] for r in reference} == {"harness/mg_inc_mc", "harness/mg_inc_ppl", "harness/mg_inc_gen"}
    for layout, results in run_distributed(_harness_report, 2, model_dir, d / "dp.yaml", timeout=300):
        assert layout == {"tp": 1, "pp": 1, "dp": 2, "processes": 2}
        assert [(r["task"], r["num_examples"]) for r in results] == [(r["task"], r["num_examples"]) for r in reference]
        for ours, ref in zip(results, reference):
            assert ours["metrics"].keys() == ref["metrics"].keys()
            for name, m in ref["metrics"].items():
                assert ours["metrics"][name]["value"] == pytest.approx(m["value"], rel=1e-6, abs=1e-6), (ref["task"], name)
