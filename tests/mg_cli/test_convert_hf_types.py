"""`mg convert` for every GPT-family Hugging Face type mg-models supports: a Qwen3 (per-head q/k norms) and a
Mixtral (mixture of experts) directory go to an mg checkpoint and back to their own class, with the original's
logits."""

from __future__ import annotations

import pytest
import torch
import transformers
from click.testing import CliRunner

from mg_cli.commands.convert import HF_TYPES
from mg_cli.main import cli
from mg_models.hf import hf_model_types


def test_export_types_are_the_supported_types():
    assert set(HF_TYPES) == set(hf_model_types())
    assert {t for t, family in hf_model_types().items() if family == "gpt"} == {
        "gpt2", "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"}


def _qwen3():
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False))
    with torch.no_grad():  # q/k norms away from their all-ones initialisation, so the mapping is exercised
        for layer in hf.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return hf


def _mixtral():
    hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2))
    with torch.no_grad():  # a router far from uniform, so every expert is chosen somewhere
        for layer in hf.model.layers:
            layer.mlp.gate.weight.normal_(0, 1.0)
    return hf


@pytest.mark.parametrize("make", [_qwen3, _mixtral], ids=["qwen3", "mixtral"])
def test_round_trip_through_an_mg_checkpoint(make, tmp_path):
    torch.manual_seed(0)
    hf = make().eval()
    hf.save_pretrained(tmp_path / "hf")
    runner = CliRunner()
    for args in (["--to", "mg", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "mg")],
                 ["--to", "hf", "--input", str(tmp_path / "mg"), "--output", str(tmp_path / "back")]):
        result = runner.invoke(cli, ["convert", *args])
        assert result.exit_code == 0, result.output
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert type(back) is type(hf) and not any(info.values()), info
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(ids).logits, hf(ids).logits, rtol=1e-5, atol=1e-5)
