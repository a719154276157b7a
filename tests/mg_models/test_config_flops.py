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


def _counted_flops(run) -> float:
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        run()
    return counter.get_total_flops()


@pytest.mark.parametrize("binary_head", [True, False])
def test_bert_flops_per_token_matches_torch_flop_counter(binary_head):
    from mg_models.bert import BertConfig, BertModel, get_bert_config

    config = get_bert_config("tiny-bert", vocab_size=200, add_binary_head=binary_head)
    model = BertModel(config)
    b, s = 2, 24
    ids = torch.randint(0, 200, (b, s))

    def run():
        logits, binary = model(ids, torch.zeros_like(ids), torch.ones_like(ids))
        (logits.sum() + (binary.sum() if binary is not None else 0)).backward()

    assert flops_per_token(config, s, padded_vocab=True) == pytest.approx(_counted_flops(run) / (b * s), rel=1e-12)
    assert flops_per_token(config, s, recompute=True) > flops_per_token(config, s)
    # The training loss projects only the masked positions.
    labels = torch.full((b, s), -100)
    labels[:, 3:7] = ids[:, 3:7]

    def run_loss():
        lm, binary = model(ids, torch.zeros_like(ids), torch.ones_like(ids), lm_labels=labels)
        (lm.sum() + (binary.sum() if binary is not None else 0)).backward()

    assert flops_per_token(config, s, padded_vocab=True, masked_lm_fraction=4 / s) == pytest.approx(
        _counted_flops(run_loss) / (b * s), rel=1e-12)
    with pytest.raises(ValueError, match="masked_lm_fraction"):
        flops_per_token(config, s, masked_lm_fraction=1.5)
    assert BertConfig.from_dict(config.to_dict()) == config and type(BertConfig.from_dict(config.to_dict())) is BertConfig


@pytest.mark.parametrize("activation, tied", [("relu", True), ("gated-gelu", False)])
def test_t5_flops_per_token_matches_torch_flop_counter(activation, tied):
    from mg_models.t5 import T5Config, T5Model, get_t5_config

    config = get_t5_config("tiny-t5", vocab_size=200, activation=activation, tie_word_embeddings=tied,
                           num_decoder_layers=3)
    model = T5Model(config)
    b, s, t = 2, 24, 10
    ids, dec = torch.randint(0, 200, (b, s)), torch.randint(0, 200, (b, t))

    def run():
        logits, _ = model(ids, dec, torch.ones_like(ids))
        logits.sum().backward()

    # Per encoder token: the whole sample's FLOPs over its encoder tokens.
    expected = _counted_flops(run) / (b * s)
    assert flops_per_token(config, s, decoder_seq_length=t, padded_vocab=True) == pytest.approx(expected, rel=1e-12)
    assert T5Config.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="decoder_seq_length"):
        flops_per_token(config, s, decoder_seq_length=0)
