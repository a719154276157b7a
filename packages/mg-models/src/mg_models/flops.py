"""Model FLOPs per token (forward + backward) for MFU reporting.

Counts the matrix multiplications only (2 FLOPs per multiply-add), as Megatron and PaLM do:
the linear layers, the attention score and value products over the full ``seq x seq`` matrix
(no causal discount, which is what a dense SDPA kernel computes), and the output head.
Backward costs twice the forward; activation recompute adds one more forward of the layers.
BERT adds its MLM transform and binary head; T5 counts encoder, decoder and cross-attention and
reports FLOPs per encoder token.
"""

from __future__ import annotations

from typing import Any

from mg_models.config import GPTConfig

__all__ = ["flops_per_token", "num_parameters"]


def num_parameters(config: GPTConfig, *, include_embedding: bool = True) -> int:
    """Parameter count of the unpadded GPT model (norms and biases included; the classification head's ``score``
    instead of the output layer with ``head="classification"``)."""
    c = config
    h, d, heads, g, f = c.hidden_size, c.head_dim, c.num_attention_heads, c.query_groups, c.ffn_size
    norm = h * (2 if c.normalization == "layernorm" else 1)
    qkv = h * (heads + 2 * g) * d + ((heads + 2 * g) * d if c.qkv_bias else 0)
    proj = heads * d * h + (h if c.add_bias_linear else 0)
    n_in = 2 if c.activation == "swiglu" else 1
    mlp = n_in * (h * f + (f if c.add_bias_linear else 0)) + f * h + (h if c.add_bias_linear else 0)
    qk_norm = 2 * d * (2 if c.normalization == "layernorm" else 1) if c.qk_layernorm else 0
    total = c.num_layers * (2 * norm + qkv + proj + mlp + qk_norm) + norm
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
    h, d, heads, g, f = c.hidden_size, c.head_dim, c.num_attention_heads, c.query_groups, c.ffn_size
    n_in = 2 if c.activation == "swiglu" else 1
    linear = h * (heads + 2 * g) * d + heads * d * h + n_in * h * f + f * h  # multiply-adds per token
    attention = 2 * seq_length * heads * d  # q.k^T and attn.v per query token
    layer_fwd = 2 * (linear + attention)
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
    return float(c.num_layers * layer_fwd * passes + head_fwd * 3)


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
