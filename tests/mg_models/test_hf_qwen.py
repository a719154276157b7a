"""Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm) <-> mg: logits, export round trip, refusals (fp32, CPU).

Randomly initialised Hugging Face models are the reference.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from mg_models import GPTModel, load_pretrained
from mg_models.hf import config_from_hf, config_to_hf, write_hf_directory

from .test_hf_parity import assert_exports_bit_exact, save_case

VOCAB = 301
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
CASES = {
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPE, head_dim=24)),  # 4*24 != 64
    "qwen2-window": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **SHAPE, use_sliding_window=True, sliding_window=5, max_window_layers=0)),
    "qwen2-yarn": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16})),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def saved(request, tmp_path_factory):
    return save_case(request.param, CASES[request.param], tmp_path_factory)


def test_logits_match(saved):
    name, hf, path = saved
    model = load_pretrained(path)
    assert model.config.qkv_bias == name.startswith("qwen2") and model.config.qk_layernorm == (name == "qwen3")
    ids = torch.randint(0, VOCAB, (3, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits
        out = model(ids)
    assert (out - ref).abs().max().item() <= 1e-5, name


def test_export_round_trip(saved, tmp_path):
    name, hf, path = saved
    _, _, model_type = assert_exports_bit_exact(path, hf, tmp_path, 40, name)
    assert model_type == name.split("-")[0]


def test_mg_model_exports_to_qwen3(tmp_path):
    """A model built by mg (its own init) exports to a Qwen3 with the same logits."""
    config = config_from_hf({"model_type": "qwen3", **SHAPE, "head_dim": 16})
    model = GPTModel(config, seed=7).eval()
    write_hf_directory(tmp_path, model.state_dict(), config, "qwen3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (model(ids, gather_logits=True) - hf(ids).logits).abs().max().item() <= 1e-5


def test_unsupported_qwen_configs_name_the_key():
    base = {"model_type": "qwen2", **SHAPE}
    with pytest.raises(ValueError, match=r"attention_bias=True is not supported for qwen3"):
        config_from_hf({**base, "model_type": "qwen3", "attention_bias": True})
    with pytest.raises(ValueError, match=r"layer_types mixing sliding and full attention \(max_window_layers=1\)"):
        config_from_hf({**base, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1})
    assert config_from_hf({**base, "use_sliding_window": True, "sliding_window": 8,
                           "max_window_layers": 0}).sliding_window == 8
    assert config_from_hf({**base, "sliding_window": 8}).sliding_window is None  # use_sliding_window is off
    llama = config_from_hf({**base, "model_type": "llama"})
    with pytest.raises(ValueError, match=r"Qwen2 export needs q/k/v biases only"):
        config_to_hf(llama, "qwen2")
    with pytest.raises(ValueError, match=r"Qwen3 export needs model.qk_layernorm=True"):
        config_to_hf(llama, "qwen3")
    with pytest.raises(ValueError, match=r"Llama/Mistral export needs no qk_layernorm"):
        config_to_hf(config_from_hf({**base, "model_type": "qwen3"}), "llama")
