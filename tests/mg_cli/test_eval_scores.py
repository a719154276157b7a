"""Each task's metrics against an independent computation with the Hugging Face model itself (fp32, CPU):
log-probabilities summed by hand, strided windows scored one by one, greedy generations from
``transformers``' ``generate``, and the formulas written out here."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
import transformers

from mg_cli.evaluation.evaluate import Evaluator
from mg_cli.evaluation.lm import LMScorer
from mg_cli.evaluation.options import EvalOptions
from mg_cli.evaluation.runner import ModelRunner, load_model
from mg_cli.evaluation.tasks import parse_task
from mg_data.tokenizers import ByteTokenizer

TOK = ByteTokenizer()
CTX = 48


def _hf_models():
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=259, n_embd=32, n_layer=2, n_head=4, n_positions=CTX, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=256, eos_token_id=256))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=259, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=CTX, bos_token_id=256, eos_token_id=256))
    return {"gpt2": gpt2, "llama": llama}


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model_pair(request, tmp_path_factory):
    hf = _hf_models()[request.param].eval()
    d = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(d)
    model, _ = load_model(d)
    return hf, LMScorer(ModelRunner(model), TOK, batch_size=3), d


def _hf_logprobs(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [s, V]


def _hf_continuation(hf, ctx, cont):
    lp = _hf_logprobs(hf, ctx + cont)
    rows = lp[len(ctx) - 1: len(ctx) + len(cont) - 1]
    picked = rows.gather(-1, torch.tensor(cont)[:, None]).squeeze(-1)
    return picked.sum().item(), bool((rows.argmax(-1) == torch.tensor(cont)).all())


def _hf_strided(hf, seq, stride):
    """log p(seq[i + 1] | up to CTX tokens before it) for every i: the first window predicts CTX tokens,
    each later one ``stride`` more, from the longest context that fits."""
    out, n, done = [], len(seq) - 1, 0
    while done < n:
        end = min(n, CTX if done == 0 else done + stride)
        start = max(0, end - CTX)
        lp = _hf_logprobs(hf, seq[start:end])
        out += [lp[pos - start, seq[pos + 1]].item() for pos in range(done, end)]  # row pos predicts seq[pos + 1]
        done = end
    return out


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_choice_acc_and_acc_norm(model_pair, tmp_path):
    hf, scorer, _ = model_pair
    rows = [{"context": f"Question {i}: pick", "choices": ["red", "a blue one", "green!", "z"], "answer": i % 4}
            for i in range(8)]
    res = Evaluator(scorer).run(parse_task(_write(tmp_path / "mc.jsonl", rows).join(["choice:", ""])))
    acc, acc_norm = [], []
    for r in rows:
        lls = [_hf_continuation(hf, list(r["context"].encode()), list((" " + c).encode()))[0] for c in r["choices"]]
        norm = [ll / len(c) for ll, c in zip(lls, r["choices"])]
        acc.append(float(max(range(4), key=lambda i: (lls[i], -i)) == r["answer"]))
        acc_norm.append(float(max(range(4), key=lambda i: (norm[i], -i)) == r["answer"]))
    assert res["metrics"]["acc"]["value"] == pytest.approx(sum(acc) / 8)
    assert res["metrics"]["acc_norm"]["value"] == pytest.approx(sum(acc_norm) / 8)
    # the log-likelihoods themselves, within 1e-5
    ours = scorer.loglikelihood([(rows[0]["context"], " red")])[0].total
    assert ours == pytest.approx(_hf_continuation(hf, list(rows[0]["context"].encode()), list(b" red"))[0], abs=1e-4)


def test_gathered_position_scores_equal_full_logits(model_pair):
    """The scorer projects only the scored positions onto the vocabulary; its scores equal log_softmax of the
    model's full [b, s, V] logits, with targets of different lengths and padded rows in one batch."""
    _, scorer, _ = model_pair
    model = scorer.runner.model
    requests = [(list(b"a context of some length"), list(b"ength")), (list(b"short"), list(b"t")),
                (list(b"x" * CTX), list(b"x" * 30)), (list(b"mid-size input"), list(b"ut")), ([256], [256])]
    got = scorer.score(requests)
    for (inp, tgt), ours in zip(requests, got):
        with torch.no_grad():
            full = F.log_softmax(model(torch.tensor([inp]), gather_logits=True)[0].float(), dim=-1)  # [s, V]
        rows = full[len(inp) - len(tgt):]
        want = rows.gather(-1, torch.tensor(tgt)[:, None]).squeeze(-1)
        assert ours.logprobs == pytest.approx(want.tolist(), abs=1e-6)
        assert ours.greedy == bool((rows.argmax(-1) == torch.tensor(tgt)).all())
    ids = torch.tensor([list(b"abcdefgh"), list(b"hgfedcba")])
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, [0, 3, 7]] = mask[1, 5] = True
    labels = torch.tensor([98, 100, 104, 99])
    with torch.no_grad():
        full, picked = model(ids, gather_logits=True), model(ids, gather_logits=True, output_mask=mask)
        loss = model(ids, labels=labels, output_mask=mask)
    assert torch.allclose(picked, full[mask], atol=1e-6, rtol=0)
    want = -F.log_softmax(full[mask], dim=-1).gather(-1, labels[:, None]).squeeze(-1)
    assert torch.allclose(loss, want, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="output_mask"):
        model(ids, output_mask=mask[:, :4])


@pytest.mark.parametrize("stride", [CTX, 20])
def test_strided_perplexity_and_bits_per_byte(model_pair, tmp_path, stride):
    hf, scorer, _ = model_pair
    texts = ["short text", "x" * 47, "a longer document that runs past the context " * 3]
    res = Evaluator(scorer, EvalOptions(stride=stride)).run(parse_task(f"perplexity:{_write(tmp_path / 't.jsonl', [{'text': t} for t in texts])}"))
    scored = [_hf_strided(hf, [256, *t.encode()], stride) for t in texts]
    nll, count = -sum(sum(x) for x in scored), sum(len(x) for x in scored)
    total_bytes = sum(len(t.encode()) for t in texts)
    m = res["metrics"]
    assert res["tokens"] == count and res["bytes"] == total_bytes
    assert m["nll_per_token"]["value"] == pytest.approx(nll / count, rel=1e-5)
    assert m["perplexity"]["value"] == pytest.approx(math.exp(nll / count), rel=1e-5)
    assert m["bits_per_byte"]["value"] == pytest.approx(nll / math.log(2) / total_bytes, rel=1e-5)


def test_cloze_greedy_accuracy_and_perplexity(model_pair, tmp_path):
    hf, scorer, _ = model_pair
    rows = [{"text": f"the number {i} is followed by {i + 1}"} for i in range(5)] + [{"context": "aaaa", "target": "a"}]
    res = Evaluator(scorer).run(parse_task(f"cloze:{_write(tmp_path / 'c.jsonl', rows)}"))
    lls, greedy = [], []
    for r in rows:
        ctx, tgt = (r["text"].rsplit(" ", 1)[0], " " + r["text"].rsplit(" ", 1)[1]) if "text" in r else (
            r["context"], r["target"])
        ll, g = _hf_continuation(hf, list(ctx.encode()), list(tgt.encode()))
        lls.append(ll)
        greedy.append(float(g))
    assert res["metrics"]["acc"]["value"] == pytest.approx(sum(greedy) / len(rows))
    assert res["metrics"]["perplexity"]["value"] == pytest.approx(math.exp(-sum(lls) / len(lls)), rel=1e-5)


def test_seq2seq_greedy_outputs_equal_transformers(model_pair, tmp_path):
    hf, scorer, _ = model_pair
    rows = [{"input": "abc", "target": "def"}, {"input": "hello there", "target": ["x", "y"]}]
    res = Evaluator(scorer, EvalOptions(max_new_tokens=6, until=())).run(
        parse_task(f"seq2seq:{_write(tmp_path / 's.jsonl', rows)}"))
    expected = []
    for r in rows:
        ids = torch.tensor([list(r["input"].encode())])
        out = hf.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=256, pad_token_id=258)[0, ids.shape[1]:]
        expected.append(TOK.decode([t for t in out.tolist() if t != 256]).strip())
    assert res["outputs"] == expected
    assert "exact_match" in res["metrics"] and "token_f1" in res["metrics"]


def test_sft_loss_over_assistant_tokens(model_pair, tmp_path):
    hf, scorer, _ = model_pair
    from mg_data.sft import ChatMLTemplate, render_conversation

    convs = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"}]},
             {"prompt": "2+2?", "completion": "4"}]
    res = Evaluator(scorer).run(parse_task(f"sft:{_write(tmp_path / 'sft.jsonl', convs)}"))
    from mg_data.sft import conversation_from_json

    nll, count = 0.0, 0
    for c in convs:
        tokens, mask = render_conversation(conversation_from_json(c, "x", 1), TOK, ChatMLTemplate())
        lps = _hf_strided(hf, tokens.tolist(), CTX)
        nll -= sum(lp for lp, m in zip(lps, mask[1:]) if m)
        count += int(mask[1:].sum())
    assert res["tokens"] == count
    assert res["metrics"]["loss"]["value"] == pytest.approx(nll / count, rel=1e-5)


def test_classification_accuracy_macro_f1_and_confusion(tmp_path):
    torch.manual_seed(1)
    hf = transformers.GPT2ForSequenceClassification(transformers.GPT2Config(
        vocab_size=259, n_embd=32, n_layer=2, n_head=4, n_positions=CTX, num_labels=3, pad_token_id=258)).eval()
    hf.save_pretrained(tmp_path / "cls")
    model, _ = load_model(tmp_path / "cls")
    scorer = LMScorer(ModelRunner(model), TOK, batch_size=4)
    rows = [{"text": f"example {i} " + "z" * i, "label": i % 3} for i in range(9)]
    res = Evaluator(scorer).run(parse_task(f"classification:{_write(tmp_path / 'c.jsonl', rows)}"))
    preds = []
    for r in rows:
        with torch.no_grad():
            preds.append(int(hf(torch.tensor([list(r["text"].encode())])).logits.argmax(-1)))
    golds = [r["label"] for r in rows]
    from sklearn import metrics as sklearn
    assert res["metrics"]["accuracy"]["value"] == pytest.approx(sklearn.accuracy_score(golds, preds))
    assert res["metrics"]["macro_f1"]["value"] == pytest.approx(sklearn.f1_score(golds, preds, average="macro"))
    assert res["confusion_matrix"] == sklearn.confusion_matrix(golds, preds, labels=range(3)).tolist()


class _CannedScorer(LMScorer):
    """Generation returns fixed completions (the model is not what this test checks)."""

    def __init__(self, completions):
        super().__init__(runner=type("R", (), {"map_examples": staticmethod(lambda items, fn: fn(items)),
                                               "max_length": 512, "family": "gpt"})(), tokenizer=TOK)
        self.completions = completions

    def generate(self, prompts, max_new_tokens, **kw):
        return [TOK.encode(self.completions.pop(0)) for _ in prompts]


def test_humaneval_runs_programs_with_a_time_limit(tmp_path):
    rows = [{"task_id": "add", "prompt": "def add(a, b):\n", "test": "def check(f):\n    assert f(2, 3) == 5\n",
             "entry_point": "add"},
            {"task_id": "loop", "prompt": "def spin():\n", "test": "def check(f):\n    f()\n", "entry_point": "spin"}]
    f = _write(tmp_path / "he.jsonl", rows)
    # add: 2 of 3 samples right; spin: never returns (killed by the time limit)
    completions = ["    return a + b\n", "    return a - b\n", "    return b + a\n\ndef unused():\n    pass\n",
                   "    while True:\n        pass\n"] * 1 + ["    while True:\n        pass\n"] * 2
    opts = EvalOptions(num_samples=3, pass_k=(1, 2, 3), temperature=0.8, timeout_s=1.0, allow_code_execution=True)
    res = Evaluator(_CannedScorer(completions), opts).run(parse_task(f"humaneval:{f}"))
    assert [p["correct"] for p in res["problems"]] == [2, 0]
    for k in (1, 2, 3):
        want = (1 - math.comb(1, k) / math.comb(3, k) + 0.0) / 2
        assert res["metrics"][f"pass@{k}"]["value"] == pytest.approx(want)
    with pytest.raises(ValueError, match="allow-code-execution"):
        Evaluator(_CannedScorer([]), EvalOptions()).run(parse_task(f"humaneval:{f}"))


def test_cli_table_and_json(model_pair, tmp_path):
    from click.testing import CliRunner

    from mg_cli.main import cli

    _, _, d = model_pair
    mc = _write(tmp_path / "mc.jsonl", [{"context": "x", "choices": ["a", "b"], "answer": 0}] * 3)
    txt = _write(tmp_path / "t.jsonl", [{"text": "some text"}])
    out = CliRunner().invoke(cli, ["eval", "--checkpoint", str(d), "--tokenizer-model", "byte", "--task",
                                   f"choice:{mc}", "--task", f"perplexity:{txt}", "--json", str(tmp_path / "r.json")])
    assert out.exit_code == 0, out.output
    assert "acc_norm" in out.output and "bits_per_byte" in out.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["layout"] == {"tp": 1, "pp": 1, "dp": 1, "processes": 1}
    assert [r["task"] for r in report["results"]] == ["choice/mc", "perplexity/t"]
    assert report["results"][0]["num_examples"] == 3 and report["results"][0]["metrics"]["acc"]["stderr"] == 0.0
    assert report["model_config"]["num_layers"] == 2 and report["checkpoint"] == str(d)
