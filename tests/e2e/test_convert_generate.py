"""`mg convert` both ways against Hugging Face `transformers`, then `mg generate` / `mg inspect` on the result."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tests.e2e.conftest import mg


def _hf_tensors(path):
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    out = {}
    for f in files:
        out.update(load_file(str(path / f)))
    return out


def _tiny_hf_model(arch):
    if arch == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=301, n_positions=64, n_embd=48, n_layer=2, n_head=4)
        return transformers.GPT2LMHeadModel(cfg)
    if arch == "llama":
        cfg = transformers.LlamaConfig(vocab_size=301, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       tie_word_embeddings=False)
        return transformers.LlamaForCausalLM(cfg)
    if arch == "bert":
        cfg = transformers.BertConfig(vocab_size=301, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=96, max_position_embeddings=64)
        return transformers.BertForPreTraining(cfg)
    # T5 v1.1 style: gated-GeLU, untied head
    cfg = transformers.T5Config(vocab_size=301, d_model=48, d_kv=12, d_ff=96, num_layers=2, num_decoder_layers=1,
                                num_heads=4, feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    return transformers.T5ForConditionalGeneration(cfg)


def _logits(model, ids):
    if isinstance(model, transformers.BertForPreTraining):
        return model(ids).prediction_logits
    if isinstance(model, transformers.T5ForConditionalGeneration):
        return model(ids, decoder_input_ids=ids[:, :5]).logits
    return model(ids).logits


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert", "t5"])
def test_hf_round_trip_through_mg_checkpoint(arch, tmp_path):
    torch.manual_seed(0)
    model = _tiny_hf_model(arch).eval()
    src = tmp_path / "hf"
    model.save_pretrained(src, safe_serialization=True)

    mg("convert", "--from", "hf", "--input", str(src), "--output", str(tmp_path / "ckpt"), "--tp", "2")
    inspect = mg("inspect", str(tmp_path / "ckpt")).stdout
    assert "iteration 0" in inspect and "checksums verified" in inspect
    family = {"gpt2": "gpt", "llama": "gpt"}.get(arch, arch)
    assert f"model family {family} (converted from Hugging Face {arch})" in inspect
    mg("convert", "--to", "hf", "--input", str(tmp_path / "ckpt"), "--output", str(tmp_path / "back"),
       "--max-shard-gb", "0.00003")  # several shards

    original, back = _hf_tensors(src), _hf_tensors(tmp_path / "back")
    if arch == "bert":  # tied aliases Hugging Face may save are not separate tensors
        original = {k: v for k, v in original.items() if not k.startswith("cls.predictions.decoder.")}
    assert sorted(back) == sorted(original)
    for name, t in original.items():
        assert torch.equal(back[name], t), name
    assert len(set(json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    reloaded = type(model).from_pretrained(tmp_path / "back").eval()
    ids = torch.randint(0, 301, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(_logits(reloaded, ids), _logits(model, ids), rtol=0, atol=0)
    if arch == "bert":  # encoder-only: generation is refused in one line, from either format
        from click.testing import CliRunner

        from mg_cli.main import cli

        for path in (src, tmp_path / "ckpt"):
            result = CliRunner().invoke(cli, ["generate", "--checkpoint", str(path), "--tokenizer-model",
                                              "unused.model", "--prompt", "x"])
            assert result.exit_code == 1 and "encoder-only" in result.stderr, result.output
            assert result.stderr.strip().splitlines() == [f"Error: {path} is a BERT model (encoder-only): it cannot "
                                                          f"generate text; use a GPT or T5 checkpoint"]


def test_t5_generate_matches_transformers_from_hf_and_mg(tmp_path, corpus):
    """Greedy `mg generate --json` on a T5 (Hugging Face directory and its mg conversion) equals `transformers`."""
    torch.manual_seed(3)
    cfg = transformers.T5Config(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                                num_heads=4, feed_forward_proj="relu", decoder_start_token_id=0, pad_token_id=0,
                                eos_token_id=1)
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    mg("convert", "--from", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "ckpt"))
    model.generation_config.eos_token_id = None  # compare all 8 steps, as --no-stop-at-eod does
    for path in (tmp_path / "hf", tmp_path / "ckpt"):
        # Two prompts of different lengths: the batch is padded, each row must decode as it would alone.
        out = mg("generate", "--checkpoint", str(path), "--tokenizer-model", str(corpus["tokenizer"]),
                 "--prompt", "def main():", "--prompt", "import os, sys  # the standard library",
                 "--max-new-tokens", "8", "--no-stop-at-eod", "--json").stdout
        rows = json.loads(out)
        assert len(rows) == 2 and len(rows[0]["prompt_ids"]) != len(rows[1]["prompt_ids"])
        for row in rows:
            ids = torch.tensor([row["prompt_ids"]])
            with torch.no_grad():
                ref = model.generate(ids, max_new_tokens=8, do_sample=False)[0, 1:].tolist()
            assert row["generated_ids"] == ref, path
            assert len(row["logprobs"]) == 8 and all(lp <= 0 for lp in row["logprobs"])


def test_generate_from_hf_directory_matches_transformers(tmp_path, corpus):
    """Greedy `mg generate --json` ids equal `transformers` generate on the same random model."""
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    out = mg("generate", "--checkpoint", str(tmp_path / "hf"), "--tokenizer-model", str(corpus["tokenizer"]),
             "--prompt", "def main():", "--max-new-tokens", "8", "--no-stop-at-eod", "--json").stdout
    row = json.loads(out)[0]
    ids = torch.tensor([row["prompt_ids"]])
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert row["generated_ids"] == ref
    assert len(row["logprobs"]) == 8 and all(lp <= 0 for lp in row["logprobs"])


def test_convert_of_a_corrupt_checkpoint_is_one_line(tmp_path):
    """A flipped byte in a shard: `mg convert --to hf` exits 1 with one line naming the file (its checksum)."""
    from click.testing import CliRunner

    from mg_cli.main import cli

    torch.manual_seed(0)
    _tiny_hf_model("gpt2").save_pretrained(tmp_path / "hf", safe_serialization=True)
    runner = CliRunner()
    result = runner.invoke(cli, ["convert", "--from", "hf", "--input", str(tmp_path / "hf"), "--output",
                                 str(tmp_path / "ckpt")])
    assert result.exit_code == 0, result.output
    shard = sorted((tmp_path / "ckpt" / "iter_0000000").glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    result = runner.invoke(cli, ["convert", "--to", "hf", "--input", str(tmp_path / "ckpt"), "--output",
                                 str(tmp_path / "back")])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and shard.name in lines[0], result.output


@pytest.mark.parametrize("arch", ["llama", "t5"])
def test_convert_to_a_layout_that_does_not_fit_is_one_line(arch, tmp_path):
    """The layout check is the model's own (one place for every family), named after the --tp/--pp given."""
    from click.testing import CliRunner

    from mg_cli.main import cli

    _tiny_hf_model(arch).save_pretrained(tmp_path / "hf", safe_serialization=True)
    result = CliRunner().invoke(cli, ["convert", "--from", "hf", "--input", str(tmp_path / "hf"), "--output",
                                      str(tmp_path / "ckpt"), "--tp", "3"])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: --tp 3 --pp 1: model.num_attention_heads=4 is not "
                                                   "divisible by parallel.tp=3"), result.output
    assert not (tmp_path / "ckpt").exists()
