"""Model FLOPs per token (forward + backward) for MFU reporting.

Counts the matrix multiplications only (2 FLOPs per multiply-add), as Megatron and PaLM do:
the linear layers, the attention score and value products over the full ``seq x seq`` matrix
(no causal discount, which is what a dense SDPA kernel computes), and the output head.
Backward costs twice the forward; activation recompute adds one more forward of the layers.
"""

from __future__ import annotations

from mg_models.config import GPTConfig

__all__ = ["flops_per_token", "num_parameters"]


def num_parameters(config: GPTConfig, *, include_embedding: bool = True) -> int:
    """Parameter count of the unpadded model (norms and biases included)."""
    c = config
    h, d, heads, g, f = c.hidden_size, c.head_dim, c.num_attention_heads, c.query_groups, c.ffn_size
    norm = h * (2 if c.normalization == "layernorm" else 1)
    qkv = h * (heads + 2 * g) * d + ((heads + 2 * g) * d if c.qkv_bias else 0)
    proj = heads * d * h + (h if c.add_bias_linear else 0)
    n_in = 2 if c.activation == "swiglu" else 1
    mlp = n_in * (h * f + (f if c.add_bias_linear else 0)) + f * h + (h if c.add_bias_linear else 0)
    qk_norm = 2 * d * (2 if c.normalization == "layernorm" else 1) if c.qk_layernorm else 0
    total = c.num_layers * (2 * norm + qkv + proj + mlp + qk_norm) + norm
    if include_embedding:
        total += c.vocab_size * h * (1 if c.tie_word_embeddings else 2)
        if c.position_embedding == "learned":
            total += c.max_position_embeddings * h
    elif not c.tie_word_embeddings:
        total += c.vocab_size * h
    return total


def flops_per_token(config: GPTConfig, seq_length: int, *, recompute: bool = False,
                    padded_vocab: bool = False) -> float:
    """Training FLOPs per token (forward + backward) for sequences of ``seq_length`` tokens.

    Args:
        config: the model.
        seq_length: tokens per sequence (attention cost grows with it).
        recompute: full activation recompute (one extra forward of every layer).
        padded_vocab: count the head over the padded vocabulary (what is computed) instead of the real one.

    Raises:
        ValueError: seq_length < 1.
    """
    if seq_length < 1:
        raise ValueError(f"seq_length={seq_length} must be >= 1")
    c = config
    h, d, heads, g, f = c.hidden_size, c.head_dim, c.num_attention_heads, c.query_groups, c.ffn_size
    n_in = 2 if c.activation == "swiglu" else 1
    linear = h * (heads + 2 * g) * d + heads * d * h + n_in * h * f + f * h  # multiply-adds per token
    attention = 2 * seq_length * heads * d  # q.k^T and attn.v per query token
    layer_fwd = 2 * (linear + attention)
    vocab = c.padded_vocab_size if padded_vocab else c.vocab_size
    head_fwd = 2 * h * vocab
    passes = 4 if recompute else 3
    return float(c.num_layers * layer_fwd * passes + head_fwd * 3)
