"""BERT's architecture (:class:`BertConfig`) and its presets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mg_models.config import GPTConfig, config_from_preset

__all__ = ["BERT_PRESETS", "BertConfig", "get_bert_config"]


@dataclass(kw_only=True)
class BertConfig(GPTConfig):
    """Architecture of a BERT encoder: the transformer fields of :class:`GPTConfig` plus BERT's own.

    Defaults follow BERT: exact GeLU, LayerNorm eps 1e-12, 512 positions, std-0.02 init everywhere.
    """

    max_position_embeddings: int = 512
    norm_eps: float = 1e-12
    scaled_output_init: bool = False
    type_vocab_size: int = 2
    """Number of token types (segments); 0 disables the token-type embedding."""
    pre_layernorm: bool = False
    """Pre-LN layers with a final LayerNorm (and no embedding LayerNorm) instead of BERT's post-LN."""
    add_binary_head: bool = True
    """Build the pooler and the 2-way binary head (next-sentence / sentence-order prediction) beside the MLM head."""
    classifier_dropout: float | None = None
    """Dropout on the pooled output before the classification head's classifier; None means hidden_dropout."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.position_embedding != "learned":
            raise ValueError(f"model.position_embedding={self.position_embedding!r}: BERT uses 'learned' positions")
        if self.normalization != "layernorm":
            raise ValueError(f"model.normalization={self.normalization!r}: BERT uses 'layernorm'")
        if self.activation not in ("gelu", "gelu_tanh"):
            raise ValueError(f"model.activation={self.activation!r}: BERT supports 'gelu' or 'gelu_tanh'")
        if not self.tie_word_embeddings:
            raise ValueError("model.tie_word_embeddings=False: BERT's MLM decoder is tied to the word embeddings")
        if self.sliding_window is not None or self.qk_layernorm or self.cross_entropy_chunk_tokens is not None:
            raise ValueError("model.sliding_window, model.qk_layernorm and model.cross_entropy_chunk_tokens are not "
                             "used by BERT; leave them unset")
        if not isinstance(self.type_vocab_size, int) or self.type_vocab_size < 0:
            raise ValueError(f"model.type_vocab_size must be an integer >= 0, got {self.type_vocab_size!r}")
        if self.classifier_dropout is not None and not 0.0 <= self.classifier_dropout < 1.0:
            raise ValueError(f"model.classifier_dropout={self.classifier_dropout} must be in [0, 1) or None")


BERT_PRESETS: dict[str, dict[str, Any]] = {
    "bert-base": dict(num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072, vocab_size=30522),
    "bert-large": dict(num_layers=24, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096,
                       vocab_size=30522),
    "tiny-bert": dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=512,
                      max_position_embeddings=128),
}
"""BERT shapes by name (fields of :class:`BertConfig`)."""


def get_bert_config(name: str, **overrides: Any) -> BertConfig:
    """The BERT preset ``name`` with ``overrides`` applied.

    Raises:
        ValueError: unknown preset (lists the valid ones) or an invalid override.
    """
    return config_from_preset(BertConfig, BERT_PRESETS, name, "BERT", **overrides)
