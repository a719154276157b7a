"""The lm-evaluation-harness adapter on mg models against the harness's own ``hf`` backend on the same
Hugging Face directory: identical acc, acc_norm and perplexities (local task YAMLs over JSONL files,
nothing downloaded) and identical greedy generations, for a small random GPT-2 and Llama."""

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
