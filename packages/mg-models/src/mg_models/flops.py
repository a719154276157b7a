"""Model FLOPs per token (forward + backward) for MFU reporting.

Counts the matrix multiplications only (2 FLOPs per multiply-add), as Megatron and PaLM do:
the linear layers, the attention score and value products over the full ``seq x seq`` matrix
(no causal discount, which is what a dense SDPA kernel computes), and the output head.
Backward costs twice the forward; activation recompute adds one more forward of the layers.
An MoE layer counts its router, the ``moe_router_topk`` experts each token goes to and the shared
expert (the active parameters; dropless, so capacity dropping is not discounted).
BERT adds its MLM transform and binary head; T5 counts encoder, decoder and cross-attention and
reports FLOPs per encoder token.
"""

from __future__ import annotations

from typing import Any

from mg_models.config import GPTConfig

__all__ = ["flops_per_token", "num_parameters"]


def _moe_mlp(c: GPTConfig, experts: int) -> int:
    """Weights of an MoE layer's MLP with ``experts`` routed experts: router, experts, shared expert and its gate."""
    h, n_in = c.hidden_size, 2 if c.activation == "swiglu" else 1
    shared = c.moe_shared_expert_intermediate_size or 0
    gate = h if c.moe_shared_expert_gate else 0
    return c.num_experts * h + (experts * c.moe_ffn_size + shared) * (n_in + 1) * h + gate


def _mlp_params(c: GPTConfig, active: bool) -> int:
    """MLP weights of all layers (biases included), the MoE layers' counting ``moe_router_topk`` experts if
    ``active``, all of them otherwise."""
    h, f, n_in = c.hidden_size, c.ffn_size, 2 if c.activation == "swiglu" else 1
    dense = n_in * (h * f + (f if c.add_bias_linear else 0)) + f * h + (h if c.add_bias_linear else 0)
    pattern = c.moe_layer_pattern
    moe = _moe_mlp(c, c.moe_router_topk if active else c.num_experts) if any(pattern) else 0
    return sum(moe if is_moe else dense for is_moe in pattern)


def num_parameters(config: GPTConfig, *, include_embedding: bool = True, active: bool = False) -> int:
    """Parameter count of the unpadded GPT model (norms and biases included; the classification head's ``score``
    instead of the output layer with ``head="classification"``). ``active``: an MoE layer counts the
    ``moe_router_topk`` experts a token goes through (plus router and shared expert) instead of all of them."""
    c = config
    h, d, heads, g = c.hidden_size, c.head_dim, c.num_attention_heads, c.query_groups
    norm = h * (2 if c.normalization == "layernorm" else 1)
    qkv = h * (heads + 2 * g) * d + ((heads + 2 * g) * d if c.qkv_bias else 0)
    proj = heads * d * h + (h if c.add_bias_linear else 0)
    qk_norm = 2 * d * (2 if c.normalization == "layernorm" else 1) if c.qk_layernorm else 0
    total = c.num_layers * (2 * norm + qkv + proj + qk_norm) + _mlp_params(c, active) + norm
    untied_output = c.has_lm_head and not c.tie_word_embeddings
    if not c.has_lm_head:
        total += h * c.num_labels
    if include_embedding:
        total += c.vocab_size * h * (2 if untied_output else 1)
        if c.position_embedding == "learned":
            total += c.max_position_embeddings * h
    elif untied_output:
        total += c.vocab_size * h
    return total


def flops_per_token(config: Any, seq_length: int, *, recompute: bool = False, padded_vocab: bool = False,
                    decoder_seq_length: int | None = None, masked_lm_fraction: float | None = None) -> float:
    """Training FLOPs per token (forward + backward) for sequences of ``seq_length`` tokens.

    GPT and BERT count per input token. BERT adds its MLM transform (dense ``h x h``) to the head and
    its pooler + binary head once per sequence (spread over its tokens); its training loss runs the
    transform and the vocabulary projection on the masked positions only, a share given by
    ``masked_lm_fraction``. A classification head (``head="classification"``) replaces the vocabulary
    projection by its layers applied once per sequence (GPT: ``score``; BERT: pooler and classifier). T5 counts
    per *encoder*
    token (``seq_length`` = encoder length): the FLOPs of a whole sample, encoder, decoder of
    ``decoder_seq_length`` tokens (self-attention, cross-attention to the encoder output, and the
    cross-attention keys/values of every encoder token in every decoder layer) and the head over the
    decoder tokens, divided by ``seq_length``.

    Args:
        config: a ``GPTConfig``, ``BertConfig`` or ``T5Config``.
        seq_length: tokens per sequence (attention cost grows with it); T5: the encoder length.
        recompute: full activation recompute (one extra forward of every layer; GPT and BERT).
        padded_vocab: count the head over the padded vocabulary (what is computed) instead of the real one.
        decoder_seq_length: T5 only: decoder tokens per sample (None: ``seq_length``).
        masked_lm_fraction: BERT only: share of the tokens that go through the MLM transform and
            projection (None: all, as when the model returns logits).

    Raises:
        ValueError: seq_length or decoder_seq_length < 1, masked_lm_fraction outside [0, 1].
    """
    if seq_length < 1:
        raise ValueError(f"seq_length={seq_length} must be >= 1")
    c = config
    vocab = c.padded_vocab_size if padded_vocab else c.vocab_size
    passes = 4 if recompute else 3
    if hasattr(c, "decoder_layers"):  # T5Config
        dec = seq_length if decoder_seq_length is None else decoder_seq_length
        return _t5_flops_per_token(c, seq_length, dec, vocab, passes)
    h, d, heads, g = c.hidden_size, c.head_dim, c.num_attention_heads, c.query_groups
    attention = 2 * seq_length * heads * d  # q.k^T and attn.v per query token
    # multiply-adds per token: q/k/v/o, and the MLP (an MoE layer's router, top-k experts and shared expert)
    layers_fwd = 2 * (c.num_layers * (h * (heads + 2 * g) * d + heads * d * h + attention) + _mlp_matmuls(c))
    head_fwd = 2 * h * vocab
    if not c.has_lm_head:
        pooler = h * h if hasattr(c, "add_binary_head") else 0  # BERT pools [CLS] first
        head_fwd = 2 * (pooler + h * c.num_labels) / seq_length
    elif hasattr(c, "add_binary_head"):  # BertConfig
        frac = 1.0 if masked_lm_fraction is None else masked_lm_fraction
        if not 0.0 <= frac <= 1.0:
            raise ValueError(f"masked_lm_fraction={masked_lm_fraction} must be in [0, 1]")
        head_fwd = frac * (head_fwd + 2 * h * h)  # the MLM transform's dense layer, then the projection
        if c.add_binary_head:
            head_fwd += 2 * (h * h + 2 * h) / seq_length  # pooler and binary head, once per sequence
    return float(layers_fwd * passes + head_fwd * 3)


def _mlp_matmuls(c: Any) -> int:
    """Multiply-adds per token of the MLPs of all layers (MoE layers: only the experts a token is sent to)."""
    h, f, n_in = c.hidden_size, c.ffn_size, 2 if c.activation == "swiglu" else 1
    moe_layers = sum(c.moe_layer_pattern) if getattr(c, "is_moe", False) else 0
    moe = _moe_mlp(c, c.moe_router_topk) if moe_layers else 0
    return (c.num_layers - moe_layers) * (n_in * h * f + f * h) + moe_layers * moe


def _t5_flops_per_token(c: Any, enc: int, dec: int, vocab: int, passes: int) -> float:
    if dec < 1:
        raise ValueError(f"decoder_seq_length={dec} must be >= 1")
    h, f, inner = c.hidden_size, c.ffn_hidden_size, c.num_attention_heads * c.kv_channels
    n_in = 2 if c.activation == "gated-gelu" else 1
    mlp = n_in * h * f + f * h
    # multiply-adds of one sample
    encoder = c.num_layers * enc * (4 * h * inner + mlp + 2 * enc * inner)
    decoder = c.decoder_layers * (dec * (4 * h * inner + 2 * dec * inner  # self-attention
                                         + 2 * h * inner + 2 * enc * inner  # cross-attention: q, out, scores
                                         + mlp)
                                  + enc * 2 * h * inner)  # cross-attention keys/values of the encoder output
    head = dec * h * vocab
    return float(2 * ((encoder + decoder) * passes + head * 3)) / enc
