"""A GEMM recipe set on a built model sees every matmul of its forward and backward pass.

Tiny GPT, MoE GPT, BERT and T5 models are built through the package's top-level API, a counting recipe is set
with ``use_gemm``, and one forward and backward pass runs under an independent count of torch's matmul calls
(:mod:`tests.mg_parallel.gemm_audit`; attention's ``scaled_dot_product_attention`` is not one of them).

Every matmul goes through the recipe: the transformer layers' (attention and MLP projections, routers,
experts) and the heads' (the vocabulary projection, plain, chunked or tied to the embedding; BERT's MLM
transform, pooler, binary head and classifier; GPT's score). The test fails when a matmul escapes it, and
when the recipe's calls differ from what the layer and head counts give.
"""

from __future__ import annotations

import math

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


def _gpt(preset: str, **overrides):
    model = GPTModel(get_config(preset, vocab_size=V, **overrides))
    labels = torch.tensor([0, 1]) if model.config.head == "classification" else _ids(B, S)
    return model, lambda: model(_ids(B, S), labels=labels).sum()


def _bert(**overrides):
    model = BertModel(BertConfig(**BERT, **overrides))
    if not model.config.has_lm_head:
        return model, lambda: model(_ids(B, S), None, None, labels=torch.tensor([1, 0])).sum()
    labels = torch.full((B, S), -100)
    labels[:, 2:5] = _ids(B, 3)

    def loss():
        lm, binary = model(_ids(B, S), None, None, lm_labels=labels)
        return lm.sum() + binary.sum()

    return model, loss


def _t5(**overrides):
    model = T5Model(T5Config(**T5, **overrides))
    return model, lambda: model(_ids(B, S), _ids(B, T), None, labels=_ids(B, T))[0].sum()


def _mlp(c) -> int:
    """Linears of a dense MLP: fc1 and fc2, and SwiGLU's gate."""
    return 3 if c.activation == "swiglu" else 2


def _expected_calls(name: str, c) -> dict[str, int]:
    """Recipe calls of one forward and backward pass, from the layer and head counts.

    Layers: each attention (fused qkv and output projection; T5's separate q, k, v, o) and MLP projection
    (two, three with SwiGLU's gate) once forward (autograd differentiates it); an MoE layer's router once, and
    each of its experts two products forward and four backward (loop path). Heads: a linear once forward (the
    vocabulary projection, BERT's MLM transform, pooler, binary head and classifier, GPT's score); the
    projection tied to the embedding (BERT, T5 at tp = 1) also two ``mm`` backward (input and weight
    gradients); the chunked loss, per chunk, a linear forward and again backward (recomputed logits) and two
    ``mm`` backward.
    """
    calls = {"linear": 0, "mm": 0}
    if name.startswith("t5"):  # encoder: self-attention + MLP; decoder: self- and cross-attention + MLP; head
        calls["linear"] = (4 + 2) * c.num_layers + (4 + 4 + 2) * c.num_decoder_layers + 1
        if c.tie_word_embeddings:
            calls["mm"] += 2
    elif name == "moe-gpt":
        calls["linear"] = (2 + 1) * c.num_layers + 1
        calls["mm"] = 6 * c.num_experts * c.num_layers
    elif name == "gpt-chunked-loss":
        chunks = math.ceil(B * S / c.cross_entropy_chunk_tokens)
        calls["linear"] = (2 + _mlp(c)) * c.num_layers + 2 * chunks
        calls["mm"] = 2 * chunks
    elif name.startswith("gpt"):  # the vocabulary projection, or the score
        calls["linear"] = (2 + _mlp(c)) * c.num_layers + 1
    elif name == "bert-classification":  # pooler, classifier
        calls["linear"] = (2 + _mlp(c)) * c.num_layers + 2
    else:  # MLM transform, tied projection; pooler, binary head
        calls["linear"] = (2 + _mlp(c)) * c.num_layers + 1 + 1 + 2
        calls["mm"] = 2
    return {kind: n for kind, n in calls.items() if n}


MODELS = {
    "gpt": lambda: _gpt("tiny-gpt2"),
    "gpt-chunked-loss": lambda: _gpt("tiny-llama", cross_entropy_chunk_tokens=5),
    "gpt-classification": lambda: _gpt("tiny-gpt2", head="classification"),
    "moe-gpt": lambda: _gpt("tiny-moe"),
    "bert": _bert,
    "bert-classification": lambda: _bert(head="classification"),
    "t5": _t5,
    "t5-untied": lambda: _t5(tie_word_embeddings=False),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_matmul_goes_through_the_recipe(name):
    torch.manual_seed(0)
    model, loss = MODELS[name]()
    recipe = CountingGemm()
    assert use_gemm(model, recipe) > 0
    with MatmulAudit(recipe) as audit:
        loss().backward()
    assert not audit.outside, f"{name}: matmuls outside the GEMM recipe: {sorted(set(audit.outside))}"
    assert sum(audit.inside.values()) == sum(recipe.calls.values()) > 0
    assert recipe.calls == _expected_calls(name, model.config)


def test_load_model_applies_the_precision_policy():
    """``load_model(precision=policy)`` builds the parameters in the policy's dtype and every layer multiplies
    through the policy's recipe (a forward pass counts its calls); no precision keeps the plain recipe."""
    from mg_models.loading import load_model
    from mg_parallel.gemm import PLAIN_GEMM, Gemm
    from mg_parallel.precision import Precision

    config = get_config("tiny-llama", vocab_size=V)
    recipe = CountingGemm()
    model = load_model(config=config, precision=Precision.from_name("bf16", gemm=recipe), inference=True).model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    holders = [m for m in model.modules() if isinstance(m.__dict__.get("gemm"), Gemm)]
    assert holders and all(m.gemm is recipe for m in holders)
    with torch.no_grad():
        logits = model(_ids(B, S))
    assert logits.dtype == torch.bfloat16 and recipe.calls["linear"] > 0
    plain = load_model(config=config).model
    assert {p.dtype for p in plain.parameters()} == {torch.get_default_dtype()}
    assert all(m.gemm is PLAIN_GEMM for m in plain.modules() if isinstance(m.__dict__.get("gemm"), Gemm))
    assert {p.dtype for p in load_model(config=config, precision="fp16").model.parameters()} == {torch.float16}
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        load_model(config=config, precision="fp8")
