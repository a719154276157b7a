"""``mg generate`` and ``mg eval`` take mg train's precision key: ``--set train.precision=bf16`` builds the model's
parameters in bf16 (as ``--dtype bf16``, now its alias, which says so on stderr); a bad value is mg train's own
one-line config error, and ``--dtype`` disagreeing with the key, or a key the command does not take, is one line."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from click.testing import CliRunner

import mg_data
import mg_models.loading
from mg_cli.main import cli
from mg_data.tokenizers import ByteTokenizer


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A random GPT-2 over the byte vocabulary as a Hugging Face directory and as the mg checkpoint converted
    from it."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=259, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=256, eos_token_id=256))
    d = tmp_path_factory.mktemp("precision")
    model.save_pretrained(d / "hf")
    result = CliRunner().invoke(cli, ["convert", "--from", "hf", "--input", str(d / "hf"), "--output",
                                      str(d / "ckpt")])
    assert result.exit_code == 0, result.output
    return {"hf": d / "hf", "mg": d / "ckpt"}


@pytest.fixture(autouse=True)
def byte_tokenizer(monkeypatch):
    monkeypatch.setattr(mg_data, "build_tokenizer", lambda *args, **kwargs: ByteTokenizer())


@pytest.fixture
def built(monkeypatch):
    """The parameter dtypes of every model the commands load, in order."""
    dtypes: list[set[torch.dtype]] = []
    load = mg_models.loading.load_model

    def recording(*args, **kwargs):
        loaded = load(*args, **kwargs)
        dtypes.append({p.dtype for chunk in loaded.chunks for p in chunk.parameters()})
        return loaded

    monkeypatch.setattr(mg_models.loading, "load_model", recording)
    return dtypes


def _invoke(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _generate(path, *args: str):
    result = _invoke("generate", "--checkpoint", path, "--tokenizer-model", "bytes", "--prompt", "def f(x):",
                     "--prompt", "import os", "--max-new-tokens", "12", "--no-stop-at-eod", "--json", *args)
    assert result.exit_code == 0, result.output
    return result, [row["generated_ids"] for row in json.loads(result.stdout)]


def _one_error_line(result) -> str:
    assert result.exit_code != 0, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("source", ["hf", "mg"])
def test_generate_set_precision_is_dtype(models, built, source):
    by_key, tokens = _generate(models[source], "--set", "train.precision=bf16")
    assert built == [{torch.bfloat16}] and by_key.stderr == ""
    by_alias, alias_tokens = _generate(models[source], "--dtype", "bf16")
    assert built[1] == {torch.bfloat16} and alias_tokens == tokens and all(len(t) == 12 for t in tokens)
    assert by_alias.stderr.strip().splitlines() == ["note: --dtype is an alias of --set train.precision=bf16"]
    _generate(models[source], "--dtype", "bf16", "--set", "train.precision=bf16")  # the same value: no conflict
    _generate(models[source])
    assert built[2:] == [{torch.bfloat16}, {torch.float32}]  # fp32 by default


def test_precision_errors_are_mg_trains_and_one_line(models):
    from mg_cli.config import ConfigError, load_config

    with pytest.raises(ConfigError) as train_error:  # what mg train says of the same --set
        load_config(None, ["train.precision=fp8"])
    for command in (["generate", "--prompt", "x"], ["eval", "--task", "perplexity:unused.jsonl"]):
        base = [*command, "--checkpoint", models["hf"], "--tokenizer-model", "bytes"]
        assert _one_error_line(_invoke(*base, "--set", "train.precision=fp8")) == f"Error: {train_error.value}"
        assert _one_error_line(_invoke(*base, "--dtype", "bf16", "--set", "train.precision=fp32")) == (
            "Error: --dtype bf16 and --set train.precision=fp32 disagree; --dtype is an alias of --set "
            "train.precision, give one of them")
    line = _one_error_line(_invoke("generate", "--checkpoint", models["hf"], "--prompt", "x", "--set",
                                   "parallel.tp=2", "--set", "model.num_layers=3", "--set", "train.precision=bf16"))
    assert line == ("Error: --set parallel.tp, model.num_layers: mg generate takes only --set "
                    "train.precision=fp32|bf16|fp16")
    line = _one_error_line(_invoke("eval", "--checkpoint", models["hf"], "--task", "perplexity:unused.jsonl",
                                   "--set", "model.num_layers=3"))
    assert line.startswith("Error: --set model.num_layers=3: mg eval takes parallel.tp=N, parallel.pp=N") and (
        "train.precision=fp32|bf16|fp16" in line)


def test_eval_set_precision(models, built, tmp_path):
    """``mg eval --set train.precision=bf16`` scores the mg checkpoint with bf16 parameters and reports the
    precision; the perplexity is within bf16's rounding of fp32's (a random model: about the vocabulary size)."""
    texts = ["def main():\n    return 0\n", "import os, sys\nprint(os.getcwd())\n"]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    reports = {}
    for name in ("bf16", "fp32"):
        out = tmp_path / f"{name}.json"
        result = _invoke("eval", "--checkpoint", models["mg"], "--tokenizer-model", "byte", "--task",
                         f"perplexity:{tmp_path / 't.jsonl'}", "--json", out, "--set", f"train.precision={name}")
        assert result.exit_code == 0, result.output
        assert f"(1 processes), {name}, " in result.stdout, result.stdout
        reports[name] = json.loads(out.read_text())
    assert built == [{torch.bfloat16}, {torch.float32}]
    assert [r["precision"] for r in reports.values()] == ["bf16", "fp32"]
    bf16, fp32 = (r["results"][0]["metrics"]["nll_per_token"]["value"] for r in reports.values())
    assert bf16 == pytest.approx(fp32, rel=2e-2) and bf16 != fp32
