"""Every parameter of every mg model carries a tensor-parallel tag from construction (sharded or
replicated), so the optimizer's grad norm and checkpoint slicing never guess at tp > 1."""

import pytest
import torch

from mg_models import GPTModel, get_config
from mg_models.bert import BertModel, get_bert_config
from mg_models.t5 import T5Model, get_t5_config

CASES = {
    "gpt2": lambda: GPTModel(get_config("tiny-gpt2")),
    "llama-qk-norm": lambda: GPTModel(get_config("tiny-llama", qk_layernorm=True)),
    "gpt2-first-stage": lambda: GPTModel(get_config("tiny-gpt2"), post_process=False, layer_range=(0, 1)),
    "gpt2-last-stage": lambda: GPTModel(get_config("tiny-gpt2"), pre_process=False, layer_range=(1, 2)),
    "bert": lambda: BertModel(get_bert_config("tiny-bert")),
    "bert-pre-ln-last-stage": lambda: BertModel(get_bert_config("tiny-bert", pre_layernorm=True), pre_process=False,
                                                layer_range=(1, 2)),
    "gpt2-classification": lambda: GPTModel(get_config("tiny-gpt2", head="classification", num_labels=3)),
    "llama-classification-last-stage": lambda: GPTModel(get_config("tiny-llama", head="classification"),
                                                        pre_process=False, layer_range=(1, 2)),
    "bert-classification": lambda: BertModel(get_bert_config("tiny-bert", head="classification", num_labels=1)),
    "t5": lambda: T5Model(get_t5_config("tiny-t5")),
    "t5-untied": lambda: T5Model(get_t5_config("tiny-t5", tie_word_embeddings=False)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_parameter_is_tagged(case):
    torch.manual_seed(0)
    model = CASES[case]()
    untagged = [n for n, p in model.named_parameters() if not isinstance(getattr(p, "tensor_parallel", None), bool)]
    assert not untagged, f"{case}: parameters without a tensor_parallel tag: {untagged}"
    for n, p in model.named_parameters():
        if p.tensor_parallel:
            assert p.partition_dim in (0, 1), n


def test_tags_say_which_parameters_are_shards():
    gpt = dict(GPTModel(get_config("tiny-gpt2", tie_word_embeddings=False)).named_parameters())
    sharded = {n for n, p in gpt.items() if p.tensor_parallel}
    assert {"embedding.word_embeddings.weight", "output_layer.weight", "decoder.layers.0.mlp.linear_fc1.bias",
            "decoder.layers.0.self_attention.linear_qkv.weight"} <= sharded
    replicated = {n for n, p in gpt.items() if not p.tensor_parallel}
    assert {"embedding.position_embeddings.weight", "decoder.layers.0.input_layernorm.weight",
            "decoder.layers.0.mlp.linear_fc2.bias", "decoder.final_layernorm.bias"} <= replicated
    bert = dict(BertModel(get_bert_config("tiny-bert")).named_parameters())
    assert bert["lm_head.bias"].tensor_parallel and bert["lm_head.bias"].partition_dim == 0
    assert not any(bert[n].tensor_parallel for n in ("pooler.weight", "binary_head.bias", "lm_head.dense.weight",
                                                     "embedding.tokentype_embeddings.weight"))
    t5 = dict(T5Model(get_t5_config("tiny-t5")).named_parameters())
    assert not t5["encoder.relative_attention_bias.weight"].tensor_parallel
