"""`mg convert` for every GPT-family Hugging Face type mg-models supports: a Qwen3 directory goes to an mg
checkpoint and back to a Qwen3ForCausalLM whose logits equal the original's."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from mg_cli.commands.convert import _GPT_TYPES
from mg_cli.main import cli
from mg_models.hf import FAMILY_OF_MODEL_TYPE

transformers = pytest.importorskip("transformers")


def test_export_types_are_the_supported_gpt_types():
    assert set(_GPT_TYPES) == {t for t, family in FAMILY_OF_MODEL_TYPE.items() if family == "gpt"}


def test_qwen3_round_trip_through_an_mg_checkpoint(tmp_path):
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)).eval()
    with torch.no_grad():  # q/k norms away from their all-ones initialisation, so the mapping is exercised
        for layer in hf.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path / "qwen3")
    runner = CliRunner()
    for args in (["--to", "mg", "--input", str(tmp_path / "qwen3"), "--output", str(tmp_path / "mg")],
                 ["--to", "hf", "--input", str(tmp_path / "mg"), "--output", str(tmp_path / "back")]):
        result = runner.invoke(cli, ["convert", *args])
        assert result.exit_code == 0, result.output
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert type(back).__name__ == "Qwen3ForCausalLM" and not any(info.values()), info
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(ids).logits, hf(ids).logits, rtol=1e-5, atol=1e-5)
