"""Hugging Face ``GPT2LMHeadModel`` / ``GPT2ForSequenceClassification`` <-> mg GPT: config and tensor mapping.

GPT-2 stores linear weights as ``Conv1D`` ``[in, out]`` (transposed w.r.t. ``nn.Linear``) and its
fused ``c_attn`` rows (after transposing) as ``[all q | all k | all v]``; mg's fused QKV is grouped
per head ``[q_h, k_h, v_h]``.
"""

from __future__ import annotations

from typing import Any

import torch

from mg_models.config import GPTConfig
from mg_models.hf.common import head_from_hf, head_to_hf, output_groups, pad_vocab, unpad_vocab
from mg_models.hf.groups import TensorGroup, mapped, rename, to_hf_state, to_mg_state

__all__ = ["config_from_hf", "config_to_hf", "state_from_hf", "state_to_hf", "tensor_groups"]

_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def config_from_hf(hf: dict[str, Any]) -> GPTConfig:
    """GPTConfig from a GPT-2 ``config.json`` dict (the classification head for ``GPT2ForSequenceClassification``).

    Raises:
        ValueError: a feature mg does not implement (names the config.json key).
    """
    act = hf.get("activation_function", "gelu_new")
    if act not in _ACTIVATIONS:
        raise ValueError(f"config.json activation_function={act!r} is not supported; use one of {sorted(_ACTIVATIONS)}")
    for key, bad in (("scale_attn_by_inverse_layer_idx", True), ("scale_attn_weights", False),
                     ("add_cross_attention", True)):
        if hf.get(key, not bad) == bad:
            raise ValueError(f"config.json {key}={bad} is not supported by mg's GPT")
    return GPTConfig(
        num_layers=hf["n_layer"], hidden_size=hf["n_embd"], num_attention_heads=hf["n_head"],
        ffn_hidden_size=hf.get("n_inner"), vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("n_positions", 1024), position_embedding="learned",
        normalization="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5), activation=_ACTIVATIONS[act],
        add_bias_linear=True, tie_word_embeddings=hf.get("tie_word_embeddings", True),
        hidden_dropout=hf.get("resid_pdrop", 0.0), attention_dropout=hf.get("attn_pdrop", 0.0),
        **head_from_hf(hf),
    )


def config_to_hf(c: GPTConfig) -> dict[str, Any]:
    """A GPT-2 ``config.json`` dict for ``c`` (``GPT2LMHeadModel``, or ``GPT2ForSequenceClassification``).

    Raises:
        ValueError: ``c`` uses a feature GPT-2 cannot express (names the field).
    """
    if c.position_embedding != "learned" or c.normalization != "layernorm" or c.activation == "swiglu":
        raise ValueError("only learned positions, layernorm and gelu map onto GPT2LMHeadModel; "
                         "export this model as llama instead")
    if not c.add_bias_linear or not c.qkv_bias or c.qk_layernorm or c.query_groups != c.num_attention_heads:
        raise ValueError("GPT2LMHeadModel needs biases, multi-head attention and no qk_layernorm")
    if c.head_dim * c.num_attention_heads != c.hidden_size:
        raise ValueError("GPT2LMHeadModel needs model.kv_channels * num_attention_heads == hidden_size")
    return {
        **head_to_hf(c, "GPT2", "GPT2LMHeadModel"), "model_type": "gpt2",
        "activation_function": "gelu_new" if c.activation == "gelu_tanh" else "gelu",
        "n_layer": c.num_layers, "n_embd": c.hidden_size, "n_head": c.num_attention_heads,
        "n_inner": c.ffn_hidden_size, "n_positions": c.max_position_embeddings, "vocab_size": c.vocab_size,
        "layer_norm_epsilon": c.norm_eps, "tie_word_embeddings": c.tie_word_embeddings,
        "resid_pdrop": c.hidden_dropout, "embd_pdrop": c.hidden_dropout, "attn_pdrop": c.attention_dropout,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "initializer_range": c.init_method_std, "use_cache": True, "dtype": "float32",
    }


def _layer_map(i: int) -> list[tuple[str, str, bool]]:
    """(hf name, mg name, is a Conv1D weight needing transpose) for layer i (qkv handled separately)."""
    h, m = f"transformer.h.{i}", f"decoder.layers.{i}"
    return [
        (f"{h}.ln_1.weight", f"{m}.input_layernorm.weight", False),
        (f"{h}.ln_1.bias", f"{m}.input_layernorm.bias", False),
        (f"{h}.attn.c_proj.weight", f"{m}.self_attention.linear_proj.weight", True),
        (f"{h}.attn.c_proj.bias", f"{m}.self_attention.linear_proj.bias", False),
        (f"{h}.ln_2.weight", f"{m}.pre_mlp_layernorm.weight", False),
        (f"{h}.ln_2.bias", f"{m}.pre_mlp_layernorm.bias", False),
        (f"{h}.mlp.c_fc.weight", f"{m}.mlp.linear_fc1.weight", True),
        (f"{h}.mlp.c_fc.bias", f"{m}.mlp.linear_fc1.bias", False),
        (f"{h}.mlp.c_proj.weight", f"{m}.mlp.linear_fc2.weight", True),
        (f"{h}.mlp.c_proj.bias", f"{m}.mlp.linear_fc2.bias", False),
    ]


def _qkv_to_mg(w: torch.Tensor, c: GPTConfig) -> torch.Tensor:
    """Conv1D c_attn weight [h, 3h] (columns [q | k | v]) -> mg fused [heads*(q_h,k_h,v_h), h]."""
    heads, d, hdim = c.num_attention_heads, c.head_dim, c.hidden_size
    return w.t().reshape(3, heads, d, hdim).transpose(0, 1).reshape(3 * heads * d, hdim).contiguous()


def _qkv_to_hf(w: torch.Tensor, c: GPTConfig) -> torch.Tensor:
    heads, d, hdim = c.num_attention_heads, c.head_dim, c.hidden_size
    return w.reshape(heads, 3, d, hdim).transpose(0, 1).reshape(3 * heads * d, hdim).t().contiguous()


def _qkv_bias_to_mg(b: torch.Tensor, c: GPTConfig) -> torch.Tensor:
    return b.reshape(3, c.num_attention_heads, c.head_dim).transpose(0, 1).reshape(-1).contiguous()


def _qkv_bias_to_hf(b: torch.Tensor, c: GPTConfig) -> torch.Tensor:
    return b.reshape(c.num_attention_heads, 3, c.head_dim).transpose(0, 1).reshape(-1).contiguous()


def _transpose(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous()


def tensor_groups(c: GPTConfig) -> list[TensorGroup]:
    """The model as per-tensor conversions (GPT-2 tensors map one to one; Conv1D weights are transposed)."""
    groups = [
        mapped("transformer.wte.weight", "embedding.word_embeddings.weight",
               lambda w: pad_vocab(w, c), lambda w: unpad_vocab(w, c)),
        rename("transformer.wpe.weight", "embedding.position_embeddings.weight"),
        rename("transformer.ln_f.weight", "decoder.final_layernorm.weight"),
        rename("transformer.ln_f.bias", "decoder.final_layernorm.bias"),
    ]
    groups += output_groups(c, "lm_head.weight")
    for i in range(c.num_layers):
        for hname, mname, conv in _layer_map(i):
            groups.append(mapped(hname, mname, _transpose, _transpose) if conv else rename(hname, mname))
        h, m = f"transformer.h.{i}.attn.c_attn", f"decoder.layers.{i}.self_attention.linear_qkv"
        groups.append(mapped(f"{h}.weight", f"{m}.weight", lambda w: _qkv_to_mg(w, c), lambda w: _qkv_to_hf(w, c)))
        groups.append(mapped(f"{h}.bias", f"{m}.bias", lambda b: _qkv_bias_to_mg(b, c),
                             lambda b: _qkv_bias_to_hf(b, c)))
    return groups


def state_from_hf(hf: dict[str, torch.Tensor], c: GPTConfig) -> dict[str, torch.Tensor]:
    """mg (tp=1, unsharded) state dict from a GPT-2 state dict. Raises KeyError naming a missing tensor."""
    return to_mg_state(tensor_groups(c), hf)


def state_to_hf(mg: dict[str, torch.Tensor], c: GPTConfig) -> dict[str, torch.Tensor]:
    """GPT-2 state dict (Hugging Face names; no ``lm_head.weight`` when tied) from an mg state dict."""
    return to_hf_state(tensor_groups(c), mg)
