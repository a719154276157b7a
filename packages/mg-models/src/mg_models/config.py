"""The transformer configuration shared by the GPT family (GPT-2 and Llama styles).

One dataclass describes every architectural choice; the layer spec (:mod:`mg_models.spec`)
turns it into modules. Parallel layout is *not* part of the config: the same config builds a
model at any tp/pp, and :func:`check_parallel` says whether a given layout fits.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["MOE_ROUTER_FIELDS", "ROTARY_SCALING_PARAMETERS", "GPTConfig", "ModelConfigBase", "check_parallel", "check_rotary_scaling",
           "config_from_preset"]

_POSITION_EMBEDDINGS = ("learned", "rope", "none")
_NORMALIZATIONS = ("layernorm", "rmsnorm")
_ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu")
_HEADS = ("lm", "classification")
_MOE_ACTIVATIONS = ("swiglu", "gelu")
MOE_ROUTER_FIELDS = ("moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax",
                     "moe_router_norm_topk_prob", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
                     "moe_z_loss_coeff", "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
                     "moe_expert_capacity_factor", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate")
"""GPTConfig fields passed unchanged to ``mg_parallel.moe.MoEConfig`` (the same names)."""
ROTARY_SCALING_PARAMETERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "linear": (("factor",), ()),
    "dynamic": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")),
}
"""Rotary scaling types of ``GPTConfig.rotary_scaling``: (required, optional) parameters, with Hugging Face's names."""


class ModelConfigBase:
    """What every model config dataclass (GPT, BERT, T5) has: the padded vocabulary and its dict form."""

    vocab_size: int
    make_vocab_size_divisible_by: int

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary rounded up to make_vocab_size_divisible_by (independent of tp, so checkpoints reshard)."""
        m = self.make_vocab_size_divisible_by
        return ((self.vocab_size + m - 1) // m) * m

    def pipeline_layers(self) -> tuple[int, str]:
        """``(layers a pipeline cuts into stages, how an error names them)``."""
        return self.num_layers, f"model.num_layers={self.num_layers}"  # type: ignore[attr-defined]

    def tp_divided(self) -> list[tuple[str, int]]:
        """``(key, value)`` of every size tensor parallelism splits (the padded vocabulary aside)."""
        return [("model.num_attention_heads", self.num_attention_heads),  # type: ignore[attr-defined]
                ("model.ffn_hidden_size", self.ffn_hidden_size)]  # type: ignore[attr-defined]

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (JSON-serialisable) for checkpoints and configs."""
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Any:
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError`` naming them."""
        known = set(cls.__dataclass_fields__)  # type: ignore[attr-defined]
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown model config keys {unknown}; valid keys are {sorted(known)}")
        return cls(**d)


@dataclass(kw_only=True)
class GPTConfig(ModelConfigBase):
    """Architecture of a decoder-only transformer language model (pre-norm, causal)."""

    num_layers: int
    """Number of transformer layers."""
    hidden_size: int
    """Width of the residual stream."""
    num_attention_heads: int
    """Number of query heads."""
    vocab_size: int
    """Tokenizer vocabulary size (unpadded); padding for tensor parallelism is internal."""
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention; None means one per query head (multi-head)."""
    kv_channels: int | None = None
    """Per-head dimension; None means hidden_size // num_attention_heads."""
    ffn_hidden_size: int | None = None
    """MLP inner width; None means 4 * hidden_size."""
    max_position_embeddings: int = 1024
    """Longest sequence the model accepts (size of the learned position table)."""
    position_embedding: str = "learned"
    """"learned" (GPT-2 absolute positions), "rope" (rotary, Llama) or "none"."""
    rotary_base: float = 10000.0
    """Rotary base (theta)."""
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions that are rotated (the leading ones)."""
    rotary_scaling: dict[str, Any] | None = None
    """Rotary frequency scaling for long contexts, e.g. {type: llama3, factor: 8.0, low_freq_factor: 1.0,
    high_freq_factor: 4.0, original_max_position_embeddings: 8192}; types linear (factor), dynamic (factor; NTK
    by sequence length beyond max_position_embeddings), llama3 and yarn (factor, original_max_position_embeddings;
    optional beta_fast, beta_slow, mscale, mscale_all_dim, attention_factor, truncate), with Hugging Face's
    parameter names. None: plain rotary."""
    normalization: str = "layernorm"
    """"layernorm" or "rmsnorm"."""
    norm_eps: float = 1e-5
    """Epsilon of every normalisation layer."""
    activation: str = "gelu"
    """"gelu" (exact), "gelu_tanh" (GPT-2's approximation) or "swiglu" (gated SiLU, Llama)."""
    add_bias_linear: bool = True
    """Biases on the attention and MLP linear layers."""
    add_qkv_bias: bool | None = None
    """Bias on the fused QKV projection only; None follows add_bias_linear."""
    qk_layernorm: bool = False
    """Normalise queries and keys per head (same norm type as the model) before attention."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    hidden_dropout: float = 0.0
    """Dropout on the embedding output and on each residual branch."""
    tie_word_embeddings: bool = True
    """Share the input embedding with the output head."""
    sliding_window: int | None = None
    """Attend only to the last this-many positions (Mistral); None for full causal attention."""
    init_method_std: float = 0.02
    """Standard deviation of the normal initialisation of weights."""
    scaled_output_init: bool = True
    """Scale output-projection init by 1/sqrt(2*num_layers) (GPT-2/Megatron)."""
    make_vocab_size_divisible_by: int = 128
    """The padded vocabulary is a multiple of this; tp must divide the padded size."""
    head: str = "lm"
    """"lm" (logits over the vocabulary) or "classification" (num_labels logits per sequence: GPT scores its last
    non-padding token, BERT its pooled [CLS]; see mg_models.heads). Without an LM head, tie_word_embeddings
    and BERT's add_binary_head have no effect."""
    num_labels: int = 2
    """Classes of the classification head (1 = regression, trained with a squared-error loss); unused by "lm"."""
    cross_entropy_chunk_tokens: int | None = None
    """None: the LM loss from the whole [tokens, vocab] logits at once; an int: the output projection and the loss in
    chunks of this many tokens (logits recomputed in backward), for large vocabularies."""
    num_experts: int | None = None
    """Experts of each mixture-of-experts layer (an mg_parallel.moe.MoELayer in place of the MLP); None: a dense
    model (no moe_* field may then be set)."""
    moe_ffn_hidden_size: int | None = None
    """FFN width of each expert; None means ffn_hidden_size."""
    moe_layer_freq: int | list[int] = 1
    """Which layers are MoE layers: k = every k-th layer from layer 0 (layers 0, k, 2k, ...; Megatron's meaning), or
    a list of 0/1 per layer, e.g. [0, 1, 1, 1] for a dense first layer."""
    moe_shared_expert_intermediate_size: int | None = None
    """FFN width of a shared expert every token goes through (Qwen2-MoE); None for none."""
    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(x w) with a learned [1, h] w (Qwen2-MoE)."""
    moe_router_topk: int = 2
    """Experts each token is sent to (k)."""
    moe_router_score_function: str = "softmax"
    """"softmax" or "sigmoid": how router logits become scores."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts, then the top k (Qwen-MoE); False: top k of the logits, then a softmax over those k
    (Mixtral)."""
    moe_router_norm_topk_prob: bool = False
    """Renormalise the k chosen probabilities to sum to 1 (with pre-softmax or sigmoid scores)."""
    moe_router_load_balancing_type: str = "aux_loss"
    """"aux_loss" (per micro-batch), "seq_aux_loss" (per sequence), "global_aux_loss" (over dp too) or "none"."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss coeff * N * sum_i f_i P_i (f_i: share of the T*k choices; 0 disables it)."""
    moe_z_loss_coeff: float | None = None
    """Weight of the router z-loss mean(logsumexp(logits)^2); None disables it."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias added to the scores for choosing experts only."""
    moe_router_bias_update_rate: float = 1e-3
    """Step of the expert-bias update bias += rate * sign(mean_load - load)."""
    moe_expert_capacity_factor: float | None = None
    """Capacity of each expert as a multiple of the even share tokens*k/num_experts (excess tokens are dropped);
    None: dropless."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_position_embeddings",
                     "make_vocab_size_divisible_by", "num_labels"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
        for name in ("num_query_groups", "kv_channels", "ffn_hidden_size", "sliding_window",
                     "cross_entropy_chunk_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"model.{name} must be a positive integer or None, got {value!r}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by model.num_attention_heads="
                f"{self.num_attention_heads}; change one of them or set model.kv_channels explicitly"
            )
        groups = self.query_groups
        if groups > self.num_attention_heads or self.num_attention_heads % groups != 0:
            raise ValueError(
                f"model.num_attention_heads={self.num_attention_heads} is not divisible by model.num_query_groups="
                f"{groups}; num_query_groups must divide the number of heads (1 = multi-query, heads = multi-head)"
            )
        if self.position_embedding not in _POSITION_EMBEDDINGS:
            raise ValueError(f"model.position_embedding={self.position_embedding!r}; use one of {_POSITION_EMBEDDINGS}")
        if self.normalization not in _NORMALIZATIONS:
            raise ValueError(f"model.normalization={self.normalization!r}; use one of {_NORMALIZATIONS}")
        if self.activation not in _ACTIVATIONS:
            raise ValueError(f"model.activation={self.activation!r}; use one of {_ACTIVATIONS}")
        if self.head not in _HEADS:
            raise ValueError(f"model.head={self.head!r}; use one of {_HEADS}")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"model.rotary_percent={self.rotary_percent} must be in (0, 1]")
        if self.position_embedding == "rope" and self.rotary_dim % 2 != 0:
            raise ValueError(
                f"model.rotary_percent={self.rotary_percent} gives an odd rotary dimension {self.rotary_dim} "
                f"(head dim {self.head_dim}); choose a percent giving an even number of dimensions"
            )
        if self.rotary_scaling is not None:
            if self.position_embedding != "rope":
                raise ValueError(f"model.rotary_scaling needs model.position_embedding='rope', not "
                                 f"{self.position_embedding!r}; remove rotary_scaling or use rotary embeddings")
            self.rotary_scaling = check_rotary_scaling(self.rotary_scaling)
            if self.rotary_scaling["type"] == "dynamic" and self.rotary_dim <= 2:
                raise ValueError(f"model.rotary_scaling of type 'dynamic' needs more than 2 rotary dimensions, got "
                                 f"{self.rotary_dim}; raise model.rotary_percent or use another type")
        for name in ("attention_dropout", "hidden_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"model.{name}={getattr(self, name)} must be in [0, 1)")
        if self.norm_eps <= 0 or self.init_method_std <= 0 or self.rotary_base <= 0:
            raise ValueError("model.norm_eps, model.init_method_std and model.rotary_base must be positive")
        self._check_moe()

    def _check_moe(self) -> None:
        """Validate the mixture-of-experts fields (through MoEConfig for the router's), naming model.<key>."""
        defaults = {f.name: f.default for f in self.__dataclass_fields__.values()}  # type: ignore[attr-defined]
        moe_keys = [n for n in defaults if n.startswith("moe_")]
        if self.num_experts is None:
            set_keys = [n for n in moe_keys if getattr(self, n) != defaults[n]]
            if set_keys:
                verb = "needs" if len(set_keys) == 1 else "need"
                raise ValueError(f"{', '.join('model.' + n for n in set_keys)} {verb} model.num_experts; set the "
                                 f"number of experts or remove them")
            return
        for name in ("num_experts", "moe_ffn_hidden_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
        freq = self.moe_layer_freq
        if isinstance(freq, list):
            if len(freq) != self.num_layers or any(v not in (0, 1) or isinstance(v, bool) for v in freq):
                raise ValueError(f"model.moe_layer_freq={freq!r} must list 0 (dense) or 1 (MoE) for each of the "
                                 f"{self.num_layers} layers (model.num_layers)")
        elif not isinstance(freq, int) or isinstance(freq, bool) or freq < 1:
            raise ValueError(f"model.moe_layer_freq={freq!r} must be a positive integer (every k-th layer) or a "
                             f"list of 0/1 per layer")
        if self.activation not in _MOE_ACTIVATIONS:
            raise ValueError(f"model.activation={self.activation!r} is not available for experts; use one of "
                             f"{_MOE_ACTIVATIONS} with model.num_experts")
        if self.add_bias_linear:
            raise ValueError("model.add_bias_linear=True is not supported with model.num_experts (experts have no "
                             "biases); set add_bias_linear: false (add_qkv_bias may stay true)")
        if isinstance(self.moe_router_topk, int) and self.moe_router_topk > self.num_experts:
            raise ValueError(f"model.moe_router_topk={self.moe_router_topk} exceeds model.num_experts="
                             f"{self.num_experts}; lower topk or add experts")
        try:
            self.moe_config()
        except ValueError as e:  # MoEConfig names its own fields: they are ours with a model. prefix
            raise ValueError(re.sub(r"(?<![\w.])(moe_\w+)", r"model.\1", str(e))) from None

    def moe_config(self) -> Any:
        """The ``mg_parallel.moe.MoEConfig`` of the MoE layers (the router fields, the expert activation).

        Raises:
            ValueError: an invalid router option (MoEConfig's own message).
        """
        from mg_parallel.moe import MoEConfig  # lazily: this module imports no torch

        return MoEConfig(**{n: getattr(self, n) for n in MOE_ROUTER_FIELDS}, moe_expert_activation=self.activation)

    @property
    def is_moe(self) -> bool:
        """Whether any layer is a mixture-of-experts layer."""
        return self.num_experts is not None and any(self.moe_layer_pattern)

    @property
    def moe_layer_pattern(self) -> list[int]:
        """1 for each MoE layer, 0 for each dense one (all 0 without num_experts)."""
        if self.num_experts is None:
            return [0] * self.num_layers
        freq = self.moe_layer_freq
        if isinstance(freq, list):
            return list(freq)
        return [int(i % freq == 0) for i in range(self.num_layers)]

    @property
    def moe_ffn_size(self) -> int:
        """FFN width of each expert."""
        return self.moe_ffn_hidden_size or self.ffn_size

    @property
    def query_groups(self) -> int:
        """Number of key/value heads (num_query_groups, defaulting to the number of heads)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """Per-head dimension."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        """MLP inner width."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def rotary_dim(self) -> int:
        """Number of rotated dimensions per head."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def qkv_bias(self) -> bool:
        """Whether the fused QKV projection has a bias."""
        return self.add_bias_linear if self.add_qkv_bias is None else self.add_qkv_bias

    @property
    def has_lm_head(self) -> bool:
        """Whether the model ends in the vocabulary projection (head "lm") rather than a classification head."""
        return self.head == "lm"

    def tp_divided(self) -> list[tuple[str, int]]:
        return [("model.num_attention_heads", self.num_attention_heads), ("model.num_query_groups", self.query_groups),
                ("model.ffn_hidden_size", self.ffn_size)]

def check_rotary_scaling(scaling: Any) -> dict[str, Any]:
    """``scaling`` validated and normalised: ``type`` first, numbers as floats (lengths as ints, truncate as bool).

    Raises:
        ValueError: not a mapping, an unknown type, or a parameter missing, unknown or out of range (names it).
    """
    key = "model.rotary_scaling"
    if not isinstance(scaling, dict):
        raise ValueError(f"{key} must be a mapping such as {{type: linear, factor: 4.0}}, got {scaling!r}")
    kind = scaling.get("type")
    if kind not in ROTARY_SCALING_PARAMETERS:
        raise ValueError(f"{key}.type={kind!r}; use one of {tuple(ROTARY_SCALING_PARAMETERS)}")
    required, optional = ROTARY_SCALING_PARAMETERS[kind]
    missing = [p for p in required if scaling.get(p) is None]
    if missing:
        raise ValueError(f"{key} of type {kind!r} is missing {', '.join(f'{key}.{p}' for p in missing)}")
    unknown = sorted(set(scaling) - {"type", *required, *optional})
    if unknown:
        raise ValueError(f"{key}: unknown parameter(s) {unknown} for type {kind!r}; its parameters are "
                         f"{list(required + optional)}")
    out: dict[str, Any] = {"type": kind}
    for name in required + optional:
        value = scaling.get(name)
        if value is None:
            continue
        if name == "truncate":
            if not isinstance(value, bool):
                raise ValueError(f"{key}.truncate={value!r} must be true or false")
        elif name == "original_max_position_embeddings":
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key}.{name}={value!r} must be a positive integer (the pretraining context)")
        elif not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or (
                value == 0 and name not in ("mscale", "mscale_all_dim")):
            raise ValueError(f"{key}.{name}={value!r} must be a positive number")
        else:
            value = float(value)
        out[name] = value
    if kind == "llama3" and out["high_freq_factor"] <= out["low_freq_factor"]:
        raise ValueError(f"{key}.high_freq_factor={out['high_freq_factor']} must exceed "
                         f"{key}.low_freq_factor={out['low_freq_factor']}")
    return out


def pipeline_layers(config: Any) -> tuple[int, str]:
    """``(layers a pipeline cuts into stages, how an error names them)`` of any family's config."""
    return config.pipeline_layers()


def check_parallel(config: Any, tp: int, pp: int = 1) -> None:
    """Check that a tp/pp layout fits ``config`` (a GPTConfig, BertConfig or T5Config): the one place it is checked.

    Raises:
        ValueError: naming the config field that tp does not divide, or fewer layers than pp stages.
    """
    checks = list(config.tp_divided())
    checks.append(("padded vocabulary (model.make_vocab_size_divisible_by)", config.padded_vocab_size))
    for what, value in checks:
        if value % tp != 0:
            raise ValueError(
                f"{what}={value} is not divisible by parallel.tp={tp}; choose a tp that divides it or change {what}"
            )
    layers, layers_key = pipeline_layers(config)
    if layers < pp:
        raise ValueError(f"{layers_key} cannot fill parallel.pp={pp} pipeline stages (one layer each at least); use fewer "
                         f"stages")


def config_from_preset(cls: type, presets: dict[str, dict[str, Any]], name: str, kind: str, **overrides: Any) -> Any:
    """``cls(**presets[name], **overrides)``: a family's preset as its config dataclass.

    Raises:
        ValueError: unknown preset (``kind`` names the family in the message, which lists the valid
            names) or an invalid override (from the dataclass's own validation).
    """
    if name not in presets:
        raise ValueError(f"unknown {kind} preset {name!r}; choose one of {sorted(presets)}")
    return cls(**{**presets[name], **overrides})
