"""Hugging Face ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` (and their
``*ForSequenceClassification``) <-> mg GPT: config and tensor mapping.

Hugging Face keeps separate q/k/v and gate/up projections; mg fuses q/k/v in the grouped layout
(per key/value group: its query heads, then its key, then its value) and keeps gate and up as
separate column-parallel linears. Hugging Face's q/k rows already use the half-split rotary
layout that mg uses, so no rotary permutation is needed (see :mod:`mg_models.hf.common` for
Meta's interleaved layout).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mg_models.config import ROTARY_SCALING_PARAMETERS, GPTConfig, check_rotary_scaling
from mg_models.hf.common import concat, head_from_hf, head_to_hf, output_groups, pad_vocab, unpad_vocab
from mg_models.hf.groups import TensorGroup, mapped, rename, to_hf_state, to_mg_state

__all__ = ["config_from_hf", "config_to_hf", "rope_from_hf", "rope_to_hf", "state_from_hf", "state_to_hf",
           "tensor_groups"]


def rope_from_hf(hf: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The mg ``rotary_base`` and ``rotary_scaling`` fields of a Hugging Face config dict, read as transformers 5.x
    reads them: ``rope_scaling`` (the older key, which wins when both are set) or ``rope_parameters``, with
    ``rope_type`` (or ``type``) and ``rope_theta`` (else the top-level ``rope_theta``). Parameters the scaling type
    does not use are ignored, as Hugging Face ignores them; llama3 and yarn without
    ``original_max_position_embeddings`` take the top-level one, else ``max_position_embeddings``.

    Raises:
        ValueError: an unsupported ``rope_type`` or invalid parameters (names the key in ``where``).
    """
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return {"rotary_base": theta, "rotary_scaling": None}
    if kind not in ROTARY_SCALING_PARAMETERS:
        raise ValueError(f"{where}: {key}.rope_type={kind!r} is not supported; mg implements 'default', "
                         f"{', '.join(repr(k) for k in ROTARY_SCALING_PARAMETERS)}")
    required, optional = ROTARY_SCALING_PARAMETERS[kind]
    scaling = {"type": kind, **{k: params[k] for k in required + optional if params.get(k) is not None}}
    if "original_max_position_embeddings" in required:
        original = hf.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = original or hf.get("max_position_embeddings", 2048)
    if kind == "yarn" and "factor" not in scaling:  # DeepSeek-style: the ratio of the two context lengths
        scaling["factor"] = hf.get("max_position_embeddings", 2048) / scaling["original_max_position_embeddings"]
    try:
        scaling = check_rotary_scaling(scaling)
    except ValueError as e:
        raise ValueError(f"{where}: {key}: {e}") from None
    return {"rotary_base": theta, "rotary_scaling": scaling}


def rope_to_hf(c: GPTConfig) -> dict[str, Any]:
    """The rotary keys of a Hugging Face config dict for ``c``: ``rope_theta``, ``rope_parameters`` (transformers
    5.x) and, when scaled, the same dict as ``rope_scaling`` (transformers 4.x reads that one)."""
    scaling = dict(c.rotary_scaling or {"type": "default"})
    params = {"rope_type": scaling.pop("type"), "rope_theta": c.rotary_base, **scaling}
    out = {"rope_theta": c.rotary_base, "rope_parameters": params}
    if c.rotary_scaling:
        out["rope_scaling"] = dict(params)
    return out


_PREFIX = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
_QWEN = ("qwen2", "qwen3")


def _biases_from_hf(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """mg's bias fields: Qwen2 has q/k/v biases only; Qwen3's and Llama's ``attention_bias`` covers q/k/v/o."""
    if model_type == "qwen2":
        return {"add_bias_linear": False, "add_qkv_bias": True}
    attn_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if model_type == "qwen3":
        if attn_bias:
            raise ValueError("config.json attention_bias=True is not supported for qwen3; mg puts the output "
                             "projection's bias together with the MLP's (model.add_bias_linear)")
        return {"add_bias_linear": False}
    if attn_bias != mlp_bias:
        raise ValueError(f"config.json attention_bias={attn_bias} with mlp_bias={mlp_bias} is not supported; "
                         f"mg puts biases on all linears or none")
    return {"add_bias_linear": attn_bias}


def _window_from_hf(hf: dict[str, Any], model_type: str) -> int | None:
    """The one sliding window of every layer (Qwen's ``layer_types`` may mix sliding and full layers: refused)."""
    if model_type not in _QWEN:
        return hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    if window is None:
        return None
    first = hf.get("max_window_layers", 28)  # Hugging Face's default
    types = hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                      for i in range(hf["num_hidden_layers"])]
    if all(t == "full_attention" for t in types):
        return None
    if all(t == "sliding_attention" for t in types):
        return window
    raise ValueError(f"config.json: use_sliding_window with layer_types mixing sliding and full attention "
                     f"(max_window_layers={first}) is not supported; mg applies one sliding_window to every layer")


def config_from_hf(hf: dict[str, Any]) -> GPTConfig:
    """GPTConfig from a Llama, Mistral, Qwen2 or Qwen3 ``config.json`` dict (the classification head for
    ``*ForSequenceClassification``). Qwen2 has q/k/v biases; Qwen3 normalises q and k per head (qk_layernorm).

    Raises:
        ValueError: a feature mg does not implement (names the config.json key).
    """
    model_type = hf.get("model_type", "llama")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act={hf['hidden_act']!r} is not supported; only 'silu' (SwiGLU)")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or (128 if model_type == "qwen3" else hf["hidden_size"] // heads)
    return GPTConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=None if head_dim * heads == hf["hidden_size"] else head_dim,
        ffn_hidden_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048), position_embedding="rope",
        **rope_from_hf(hf), rotary_percent=float(hf.get("partial_rotary_factor", 1.0)),
        normalization="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6), activation="swiglu",
        **_biases_from_hf(hf, model_type), qk_layernorm=model_type == "qwen3",
        tie_word_embeddings=hf.get("tie_word_embeddings", False), attention_dropout=hf.get("attention_dropout", 0.0),
        sliding_window=_window_from_hf(hf, model_type), **head_from_hf(hf),
    )


def _check_exportable(c: GPTConfig, model_type: str) -> None:
    if model_type not in _PREFIX:
        raise ValueError(f"model_type={model_type!r} is not a Llama-like format; use one of {sorted(_PREFIX)}")
    if c.num_experts is not None:
        raise ValueError(f"a model with model.num_experts cannot be exported as {model_type!r}; use model_type "
                         f"'mixtral', 'qwen2_moe' or 'qwen3_moe'")
    if c.position_embedding != "rope" or c.normalization != "rmsnorm" or c.activation != "swiglu":
        raise ValueError(f"only rope + rmsnorm + swiglu models map onto {_PREFIX[model_type]}")
    if c.rotary_percent != 1.0:
        raise ValueError(f"{_PREFIX[model_type]} export needs model.rotary_percent=1")
    if model_type == "qwen2" and (c.add_bias_linear or not c.qkv_bias or c.qk_layernorm):
        raise ValueError("Qwen2 export needs q/k/v biases only (model.add_qkv_bias=True, model.add_bias_linear=False) "
                         "and no qk_layernorm")
    if model_type == "qwen3" and (c.add_bias_linear or c.qkv_bias or not c.qk_layernorm):
        raise ValueError("Qwen3 export needs model.qk_layernorm=True and no biases")
    if model_type in ("llama", "mistral") and (c.qk_layernorm or c.qkv_bias != c.add_bias_linear):
        raise ValueError("Llama/Mistral export needs no qk_layernorm and uniform biases")
    if c.sliding_window is not None and model_type == "llama":
        raise ValueError("model.sliding_window needs model_type='mistral' (or a Qwen type) on export")


def config_to_hf(c: GPTConfig, model_type: str = "llama") -> dict[str, Any]:
    """A Llama, Mistral, Qwen2 or Qwen3 (``model_type``) ``config.json`` dict for ``c`` (``*ForCausalLM``, or
    ``*ForSequenceClassification`` for the classification head).

    Raises:
        ValueError: ``c`` uses a feature the format cannot express (names the field).
    """
    _check_exportable(c, model_type)
    prefix = _PREFIX[model_type]
    out: dict[str, Any] = {
        **head_to_hf(c, prefix, f"{prefix}ForCausalLM"), "model_type": model_type, "hidden_act": "silu",
        "num_hidden_layers": c.num_layers, "hidden_size": c.hidden_size, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.query_groups, "head_dim": c.head_dim, "intermediate_size": c.ffn_size,
        "vocab_size": c.vocab_size, "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.norm_eps, **rope_to_hf(c),
        "tie_word_embeddings": c.tie_word_embeddings, "attention_dropout": c.attention_dropout,
        "initializer_range": c.init_method_std, "use_cache": True, "dtype": "float32",
    }
    if model_type == "mistral":
        out["sliding_window"] = c.sliding_window
    elif model_type in _QWEN:  # one window for every layer: sliding from layer 0
        out.update(use_sliding_window=c.sliding_window is not None, sliding_window=c.sliding_window,
                   max_window_layers=0 if c.sliding_window is not None else c.num_layers)
        if model_type == "qwen3":
            out["attention_bias"] = False
    else:
        out["attention_bias"] = out["mlp_bias"] = c.add_bias_linear
    return out


def _plain_map(i: int, bias: bool, dense_mlp: bool) -> list[tuple[str, str]]:
    h, m = f"model.layers.{i}", f"decoder.layers.{i}"
    pairs = [
        (f"{h}.input_layernorm.weight", f"{m}.input_layernorm.weight"),
        (f"{h}.post_attention_layernorm.weight", f"{m}.pre_mlp_layernorm.weight"),
    ]
    linears = [("self_attn.o_proj", "self_attention.linear_proj")]
    if dense_mlp:
        linears += [("mlp.gate_proj", "mlp.linear_gate"), ("mlp.up_proj", "mlp.linear_fc1"),
                    ("mlp.down_proj", "mlp.linear_fc2")]
    for hn, mn in linears:
        pairs.append((f"{h}.{hn}.weight", f"{m}.{mn}.weight"))
        if bias:
            pairs.append((f"{h}.{hn}.bias", f"{m}.{mn}.bias"))
    return pairs


def _qkv_group(c: GPTConfig, i: int, suffix: str) -> TensorGroup:
    """Separate q/k/v [heads*d, ...] <-> mg fused QKV grouped per key/value group [g*(q..., k, v), ...]."""
    g, qpg, d = c.query_groups, c.num_attention_heads // c.query_groups, c.head_dim

    def to_mg(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor]:
        rest = q.shape[1:]
        fused = concat([q.reshape(g, qpg * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)
        return (fused.reshape(g * (qpg + 2) * d, *rest),)

    def to_hf(fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rest = fused.shape[1:]
        q, k, v = fused.reshape(g, (qpg + 2) * d, *rest).split([qpg * d, d, d], dim=1)
        return (q.reshape(g * qpg * d, *rest).contiguous(), k.reshape(g * d, *rest).contiguous(),
                v.reshape(g * d, *rest).contiguous())

    a = f"model.layers.{i}.self_attn"
    return TensorGroup(tuple(f"{a}.{p}_proj.{suffix}" for p in "qkv"),
                       (f"decoder.layers.{i}.self_attention.linear_qkv.{suffix}",), to_mg, to_hf)


def tensor_groups(c: GPTConfig, moe_groups: Callable[[int], list[TensorGroup]] | None = None) -> list[TensorGroup]:
    """The model as per-tensor conversions: renames, vocabulary padding, and one q/k/v fusion group per layer.

    ``moe_groups(i)`` gives the groups of the MLP of MoE layer ``i`` (see :mod:`mg_models.gpt.hf_moe`).

    Raises:
        ValueError: ``c`` has MoE layers and no ``moe_groups`` is given (a Llama-like format has no experts).
    """
    pattern = c.moe_layer_pattern
    if any(pattern) and moe_groups is None:
        raise ValueError("a model with model.num_experts maps onto Mixtral, Qwen2-MoE or Qwen3-MoE only; export it as "
                         "model_type 'mixtral', 'qwen2_moe' or 'qwen3_moe'")
    groups = [
        mapped("model.embed_tokens.weight", "embedding.word_embeddings.weight",
               lambda w: pad_vocab(w, c), lambda w: unpad_vocab(w, c)),
        rename("model.norm.weight", "decoder.final_layernorm.weight"),
    ]
    groups += output_groups(c, "lm_head.weight")
    for i in range(c.num_layers):
        groups += [rename(h, m) for h, m in _plain_map(i, c.add_bias_linear, dense_mlp=not pattern[i])]
        if pattern[i]:
            groups += moe_groups(i)
        if c.qk_layernorm:  # Qwen3's per-head q/k RMSNorm
            groups += [rename(f"model.layers.{i}.self_attn.{x}_norm.weight",
                              f"decoder.layers.{i}.self_attention.{x}_layernorm.weight") for x in "qk"]
        groups += [_qkv_group(c, i, suffix) for suffix in (("weight", "bias") if c.qkv_bias else ("weight",))]
    return groups


def state_from_hf(hf: dict[str, torch.Tensor], c: GPTConfig) -> dict[str, torch.Tensor]:
    """mg (tp=1, unsharded) state dict from a Llama/Mistral/Qwen state dict. Raises KeyError naming a missing tensor."""
    return to_mg_state(tensor_groups(c), hf)


def state_to_hf(mg: dict[str, torch.Tensor], c: GPTConfig) -> dict[str, torch.Tensor]:
    """Llama/Mistral/Qwen state dict (Hugging Face names; no ``lm_head.weight`` when tied) from an mg state dict."""
    return to_hf_state(tensor_groups(c), mg)
