"""Ready-made model configurations by name (``get_config("gpt2-small")``).

Every family's presets have one shape, ``{name: {config field: value}}`` (GPT here, BERT's in
``bert.BERT_PRESETS``, T5's in ``t5.T5_PRESETS``), and one getter, :func:`config_from_preset`.
"""

from __future__ import annotations

from typing import Any

from mg_models.config import GPTConfig, config_from_preset

__all__ = ["PRESETS", "get_config", "list_presets"]


def _gpt2(layers: int, hidden: int, heads: int) -> dict[str, Any]:
    return dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, vocab_size=50257,
                max_position_embeddings=1024, position_embedding="learned", normalization="layernorm",
                norm_eps=1e-5, activation="gelu_tanh", add_bias_linear=True, tie_word_embeddings=True)


def _llama(layers: int, hidden: int, heads: int, ffn: int, *, groups: int | None = None, vocab: int = 32000,
           max_pos: int = 4096, base: float = 10000.0, eps: float = 1e-5, **extra: Any) -> dict[str, Any]:
    return dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
                ffn_hidden_size=ffn, vocab_size=vocab, max_position_embeddings=max_pos, position_embedding="rope",
                rotary_base=base, normalization="rmsnorm", norm_eps=eps, activation="swiglu",
                add_bias_linear=False, tie_word_embeddings=False, **extra)


PRESETS: dict[str, dict[str, Any]] = {
    "gpt2-small": _gpt2(12, 768, 12),
    "gpt2-medium": _gpt2(24, 1024, 16),
    "gpt2-large": _gpt2(36, 1280, 20),
    "gpt2-xl": _gpt2(48, 1600, 25),
    "llama-7b": _llama(32, 4096, 32, 11008),
    "llama-13b": _llama(40, 5120, 40, 13824),
    "llama-70b": _llama(80, 8192, 64, 28672, groups=8),
    "llama3-8b": _llama(32, 4096, 32, 14336, groups=8, vocab=128256, max_pos=8192, base=500000.0),
    "mistral-7b": _llama(32, 4096, 32, 14336, groups=8, max_pos=32768, sliding_window=4096),
    # Mixture of experts (shapes and routing of the published checkpoints; aux coefficients as their import gives).
    "mixtral-8x7b": _llama(32, 4096, 32, 14336, groups=8, max_pos=32768, base=1e6, num_experts=8,
                           moe_router_topk=2, moe_aux_loss_coeff=0.04),
    "qwen3-30b-a3b": _llama(48, 2048, 32, 6144, groups=4, vocab=151936, max_pos=40960, base=1e6, eps=1e-6,
                            kv_channels=128, qk_layernorm=True, num_experts=128, moe_ffn_hidden_size=768,
                            moe_router_topk=8, moe_router_pre_softmax=True, moe_router_norm_topk_prob=True,
                            moe_aux_loss_coeff=0.008),
    # nanoGPT's character/BPE demo shape (~14M parameters with an 8192 vocabulary).
    "gpt-14m": dict(num_layers=6, hidden_size=384, num_attention_heads=6, vocab_size=8192,
                    max_position_embeddings=256, activation="gelu", add_bias_linear=False),
    "gpt-30m": dict(num_layers=8, hidden_size=512, num_attention_heads=8, vocab_size=8192,
                    max_position_embeddings=256, activation="gelu", add_bias_linear=False),
    # Tiny shapes for tests and the demo.
    "tiny-gpt2": dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512,
                      max_position_embeddings=128, activation="gelu_tanh"),
    "tiny-llama": _llama(2, 64, 4, 160, groups=2, vocab=512, max_pos=128),
    "tiny-moe": _llama(2, 64, 4, 160, groups=2, vocab=512, max_pos=128, num_experts=4, moe_ffn_hidden_size=64,
                       moe_router_topk=2, moe_aux_loss_coeff=1e-2),
}
"""GPT shapes by name (fields of :class:`GPTConfig`)."""


def list_presets() -> list[str]:
    """Names accepted by :func:`get_config`."""
    return sorted(PRESETS)


def get_config(name: str, **overrides: Any) -> GPTConfig:
    """The preset ``name`` as a :class:`GPTConfig`, with ``overrides`` applied to its fields.

    Raises:
        ValueError: unknown preset name (lists the valid ones) or an invalid override.
    """
    return config_from_preset(GPTConfig, PRESETS, name, "model", **overrides)
