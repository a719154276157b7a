"""A GEMM recipe set on a built model sees every matmul of its forward and backward pass.

Tiny GPT, MoE GPT, BERT and T5 models are built through the package's top-level API, a counting recipe is set
with ``use_gemm``, and one forward and backward pass runs under an independent count of torch's matmul calls
(:mod:`tests.mg_parallel.gemm_audit`; attention's ``scaled_dot_product_attention`` is not one of them).

Every matmul of the transformer layers (attention and MLP projections, routers, experts) goes through the
recipe. The output heads of mg_models do not hold a recipe yet: their matmuls are listed in ``UNROUTED`` by the
function that makes them, and the test requires exactly those, so it fails both when another matmul escapes
and when a head starts using the recipe (then drop its entry).
"""

from __future__ import annotations

import pytest
import torch

from mg_models import BertConfig, BertModel, GPTModel, T5Config, T5Model, get_config
from mg_parallel.gemm import use_gemm
from tests.mg_parallel.gemm_audit import CountingGemm, MatmulAudit

B, S, T, V = 2, 8, 6, 301
BERT = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, vocab_size=V,
            max_position_embeddings=16)
T5 = dict(num_layers=2, num_decoder_layers=2, hidden_size=32, num_attention_heads=4, kv_channels=8, ffn_hidden_size=48,
          vocab_size=V, relative_attention_num_buckets=8, relative_attention_max_distance=10)


def _ids(*shape: int) -> torch.Tensor:
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(sum(shape)))


def _gpt(preset: str):
    model = GPTModel(get_config(preset, vocab_size=V))
    return model, lambda: model(_ids(B, S), labels=_ids(B, S)).sum()


def _bert():
    model = BertModel(BertConfig(**BERT))
    labels = torch.full((B, S), -100)
    labels[:, 2:5] = _ids(B, 3)

    def loss():
        lm, binary = model(_ids(B, S), None, None, lm_labels=labels)
        return lm.sum() + binary.sum()

    return model, loss


def _t5():
    model = T5Model(T5Config(**T5))
    return model, lambda: model(_ids(B, S), _ids(B, T), None, labels=_ids(B, T))[0].sum()


_LM_HEAD = {"ParallelLMHead.forward"}  # F.linear onto the vocabulary shard
_TIED_HEAD = {"_TiedProjection.forward", "_TiedProjection.backward"}  # tied projection onto the vocabulary (tp=1)
UNROUTED = {
    "gpt": _LM_HEAD,
    "moe-gpt": _LM_HEAD,
    # the MLM head's dense layer, the pooler and the binary head (nn.Linear) and the tied MLM projection
    "bert": {"BertLMHead.forward", "BertModel._pooled", "BertModel.forward", *_TIED_HEAD},
    "t5": _TIED_HEAD,
}



def _expected_calls(name: str, c) -> dict[str, int]:
    """Recipe calls of one forward and backward pass, from the layer counts: each attention (fused qkv and
    output projection; T5's separate q, k, v, o) and MLP projection once forward (autograd differentiates it);
    an MoE layer's router once, and each of its experts two products forward and four backward (loop path)."""
    if name == "t5":  # encoder: self-attention + MLP; decoder: self- and cross-attention + MLP
        return {"linear": (4 + 2) * c.num_layers + (4 + 4 + 2) * c.num_decoder_layers}
    if name == "moe-gpt":
        return {"linear": (2 + 1) * c.num_layers, "mm": 6 * c.num_experts * c.num_layers}
    return {"linear": (2 + 2) * c.num_layers}


MODELS = {"gpt": lambda: _gpt("tiny-gpt2"), "moe-gpt": lambda: _gpt("tiny-moe"), "bert": _bert, "t5": _t5}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_matmul_goes_through_the_recipe(name):
    torch.manual_seed(0)
    model, loss = MODELS[name]()
    recipe = CountingGemm()
    assert use_gemm(model, recipe) > 0
    with MatmulAudit(recipe) as audit:
        loss().backward()
    where = {site.split(" in ")[1].split(" (")[0] for site in audit.outside}
    assert where == UNROUTED[name], f"{name}: matmuls outside the GEMM recipe: {sorted(set(audit.outside))}"
    assert sum(audit.inside.values()) == sum(recipe.calls.values()) > 0
    assert recipe.calls == _expected_calls(name, model.config)
