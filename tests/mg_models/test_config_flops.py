"""Presets, parameter counts and the FLOPs counter against independent references."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mg_models import GPTConfig, GPTModel, flops_per_token, get_config, list_presets, num_parameters


def test_presets_build_and_have_published_sizes():
    for name in list_presets():
        assert isinstance(get_config(name), GPTConfig)
    # Published parameter counts of GPT-2 small and Llama-7B.
    assert num_parameters(get_config("gpt2-small")) == 124_439_808
    assert num_parameters(get_config("llama-7b")) == 6_738_415_616
    assert 13e6 < num_parameters(get_config("gpt-14m")) < 15e6
    assert get_config("tiny-llama", vocab_size=99).vocab_size == 99
    with pytest.raises(ValueError, match="unknown model preset 'gpt5'"):
        get_config("gpt5")


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-llama"])
def test_parameter_count_matches_built_model(preset):
    config = get_config(preset, vocab_size=200)
    model = GPTModel(config)
    padding_rows = config.padded_vocab_size - config.vocab_size
    heads = 1 if config.tie_word_embeddings else 2
    built = sum(p.numel() for p in model.parameters())
    assert built - heads * padding_rows * config.hidden_size == num_parameters(config)


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-llama"])
def test_flops_per_token_matches_torch_flop_counter(preset):
    """Reference: torch's FlopCounterMode over a real forward+backward (math SDPA, so attention is counted)."""
    config = get_config(preset, vocab_size=256)
    model = GPTModel(config)
    b, s = 2, 24
    ids = torch.randint(0, 256, (b, s))
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        model(ids, labels=ids).sum().backward()
    assert flops_per_token(config, s, padded_vocab=True) == counter.get_total_flops() / (b * s)
    assert flops_per_token(config, s, recompute=True) > flops_per_token(config, s)
    with pytest.raises(ValueError, match="seq_length"):
        flops_per_token(config, 0)


def test_config_round_trip_and_unknown_keys():
    config = get_config("tiny-llama")
    assert GPTConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="unknown model config keys \\['hiden_size'\\]"):
        GPTConfig.from_dict({**config.to_dict(), "hiden_size": 3})
