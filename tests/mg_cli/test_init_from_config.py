"""checkpoint.init_from reads only the architecture up front (the launcher's preflight and resumed runs need no
weights): the config it derives from config.json and the tensor names is the one load_pretrained builds the model
from, for every family and head; the weights come when first asked for."""

from __future__ import annotations

import pytest
import torch
import transformers

from mg_cli.training.pretrained import read_pretrained
from mg_models import load_pretrained


def _models():
    t = transformers
    gpt2 = t.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32, pad_token_id=0)
    llama = t.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    bert = t.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=24, max_position_embeddings=32, num_labels=3)
    t5 = dict(vocab_size=64, d_model=16, d_kv=8, d_ff=24, num_layers=2, num_heads=2)
    return {
        "gpt2": lambda: t.GPT2LMHeadModel(gpt2),
        "llama": lambda: t.LlamaForCausalLM(llama),
        "gpt2-classification": lambda: t.GPT2ForSequenceClassification(gpt2),
        "bert-mlm": lambda: t.BertForPreTraining(bert),
        "bert-classification": lambda: t.BertForSequenceClassification(bert),
        "t5-tied": lambda: t.T5ForConditionalGeneration(t.T5Config(**t5)),
        "t5-untied": lambda: t.T5ForConditionalGeneration(t.T5Config(**t5, tie_word_embeddings=False)),
    }


@pytest.mark.parametrize("name", list(_models()))
def test_architecture_without_weights_is_load_pretrained_s(name, tmp_path):
    torch.manual_seed(0)
    _models()[name]().save_pretrained(tmp_path)
    pretrained = read_pretrained(str(tmp_path))
    assert pretrained._params is None  # nothing read yet
    model = load_pretrained(tmp_path, dtype=torch.float32)
    assert pretrained.config == model.config
    params = pretrained.params
    assert params.keys() == dict(model.named_parameters()).keys()
    for k, v in model.named_parameters():
        assert torch.equal(params[k], v.detach()), k
