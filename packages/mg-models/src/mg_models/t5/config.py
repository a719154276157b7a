"""T5's architecture (:class:`T5Config`) and its presets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mg_models.config import ModelConfigBase, config_from_preset

__all__ = ["T5_PRESETS", "T5Config", "get_t5_config"]


@dataclass(kw_only=True)
class T5Config(ModelConfigBase):
    """Architecture of a T5 encoder-decoder."""

    num_layers: int
    """Encoder layers."""
    hidden_size: int
    """Width of the residual stream (T5's d_model)."""
    num_attention_heads: int
    """Attention heads."""
    kv_channels: int | None = None
    """Per-head dimension (T5's d_kv; heads * kv_channels need not equal hidden_size); None means
    hidden_size // num_attention_heads."""
    ffn_hidden_size: int | None = None
    """MLP inner width (T5's d_ff); None means 4 * hidden_size."""
    vocab_size: int
    """Tokenizer vocabulary (unpadded)."""
    num_decoder_layers: int | None = None
    """Decoder layers; None means num_layers."""
    activation: str = "relu"
    """"relu" (T5 v1.0) or "gated-gelu" (v1.1: gelu_tanh(wi_0 x) * wi_1 x)."""
    relative_attention_num_buckets: int = 32
    """Buckets of the relative position bias (shared by the layers of each stack)."""
    relative_attention_max_distance: int = 128
    """Relative distances beyond this share the last bucket."""
    norm_eps: float = 1e-6
    """Epsilon of every RMS normalisation."""
    dropout: float = 0.0
    """Dropout on the embedding, every residual branch, the attention probabilities and the final norms."""
    tie_word_embeddings: bool = True
    """The output head is the shared word embedding."""
    scale_decoder_output: bool | None = None
    """Scale the decoder output by hidden_size**-0.5 before the head; None follows tie_word_embeddings."""
    init_factor: float = 1.0
    """Multiplier of T5's fan-in based init stds."""
    make_vocab_size_divisible_by: int = 128
    """The padded vocabulary is a multiple of this; tp must divide the padded size."""

    def __post_init__(self) -> None:
        if self.kv_channels is None and isinstance(self.hidden_size, int) and isinstance(self.num_attention_heads, int):
            self.kv_channels = self.hidden_size // max(1, self.num_attention_heads)
        if self.ffn_hidden_size is None and isinstance(self.hidden_size, int):
            self.ffn_hidden_size = 4 * self.hidden_size
        for name in ("num_layers", "hidden_size", "num_attention_heads", "kv_channels", "ffn_hidden_size",
                     "vocab_size", "relative_attention_num_buckets", "relative_attention_max_distance",
                     "make_vocab_size_divisible_by"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
        if self.num_decoder_layers is not None and (not isinstance(self.num_decoder_layers, int)
                                                    or self.num_decoder_layers < 1):
            raise ValueError(f"model.num_decoder_layers must be a positive integer or None, got "
                             f"{self.num_decoder_layers!r}")
        if self.activation not in ("relu", "gated-gelu"):
            raise ValueError(f"model.activation={self.activation!r}; use 'relu' (T5 v1.0) or 'gated-gelu' (v1.1)")
        if self.relative_attention_num_buckets < 4 or self.relative_attention_num_buckets % 2:
            raise ValueError(f"model.relative_attention_num_buckets={self.relative_attention_num_buckets} must be an "
                             f"even number >= 4")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout={self.dropout} must be in [0, 1)")
        if self.norm_eps <= 0 or self.init_factor <= 0:
            raise ValueError("model.norm_eps and model.init_factor must be positive")

    @property
    def decoder_layers(self) -> int:
        """Number of decoder layers."""
        return self.num_decoder_layers or self.num_layers

    @property
    def scale_output(self) -> bool:
        """Whether the decoder output is scaled by hidden_size**-0.5 before the head."""
        return self.tie_word_embeddings if self.scale_decoder_output is None else self.scale_decoder_output

    @property
    def normalization(self) -> str:
        """T5 normalises with RMSNorm everywhere (the name GPT's config gives its choice)."""
        return "rmsnorm"

    def pipeline_layers(self) -> tuple[int, str]:
        layers = self.num_layers + self.decoder_layers
        return layers, f"the {layers} encoder and decoder layers (model.num_layers + model.num_decoder_layers)"


def _t5(layers: int, hidden: int, heads: int, ffn: int, **kw: Any) -> dict[str, Any]:
    return dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, kv_channels=64, ffn_hidden_size=ffn,
                vocab_size=32128, **kw)


T5_PRESETS: dict[str, dict[str, Any]] = {
    "t5-small": _t5(6, 512, 8, 2048),
    "t5-base": _t5(12, 768, 12, 3072),
    "t5-v1_1-small": _t5(8, 512, 6, 1024, activation="gated-gelu", tie_word_embeddings=False),
    "tiny-t5": dict(num_layers=2, hidden_size=64, num_attention_heads=4, kv_channels=16, ffn_hidden_size=128,
                    vocab_size=512),
}
"""T5 shapes by name (fields of :class:`T5Config`)."""


def get_t5_config(name: str, **overrides: Any) -> T5Config:
    """The T5 preset ``name`` with ``overrides`` applied.

    Raises:
        ValueError: unknown preset (lists the valid ones) or an invalid override.
    """
    return config_from_preset(T5Config, T5_PRESETS, name, "T5", **overrides)
