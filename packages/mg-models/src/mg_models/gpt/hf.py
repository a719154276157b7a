"""The GPT family's Hugging Face adapter: one front over the architectures it reads and writes (GPT-2 in
:mod:`~mg_models.gpt.hf_gpt2`; Llama, Mistral, Qwen2 and Qwen3 in :mod:`~mg_models.gpt.hf_llama`; Mixtral,
Qwen2-MoE and Qwen3-MoE in :mod:`~mg_models.gpt.hf_moe`)."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import torch

from mg_models.config import GPTConfig
from mg_models.gpt import hf_gpt2, hf_llama, hf_moe
from mg_models.hf.groups import TensorGroup

__all__ = ["SUPPORTED_MODEL_TYPES", "config_from_hf", "config_to_hf", "is_ignored", "state_from_hf", "state_to_hf",
           "tensor_groups"]

SUPPORTED_MODEL_TYPES = MappingProxyType({
    "gpt2": hf_gpt2, "llama": hf_llama, "mistral": hf_llama, "qwen2": hf_llama, "qwen3": hf_llama,
    "mixtral": hf_moe.MIXTRAL, "qwen2_moe": hf_moe.QWEN_MOE, "qwen3_moe": hf_moe.QWEN_MOE})
"""The GPT-family Hugging Face architectures: ``model_type`` -> its adapter."""
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")
"""Non-parameter buffers some GPT-2 checkpoints carry (the causal mask); safe to drop."""


def _adapter(model_type: str, where: str) -> Any:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{where}: model_type={model_type!r} is not supported; supported: "
                         f"{sorted(SUPPORTED_MODEL_TYPES)}")
    return SUPPORTED_MODEL_TYPES[model_type]


def config_from_hf(hf_config: dict[str, Any], where: str = "config.json") -> GPTConfig:
    """GPTConfig from a Hugging Face config dict. Raises ValueError for unsupported models/features."""
    return _adapter(hf_config.get("model_type", ""), where).config_from_hf(hf_config)


def config_to_hf(config: GPTConfig, model_type: str) -> dict[str, Any]:
    """The ``config.json`` dict of ``config`` exported as ``model_type``."""
    adapter = _adapter(model_type, "config_to_hf")
    return adapter.config_to_hf(config) if model_type == "gpt2" else adapter.config_to_hf(config, model_type)


def state_from_hf(hf_state: dict[str, torch.Tensor], config: GPTConfig, model_type: str) -> dict[str, torch.Tensor]:
    """Unsharded mg state dict from a Hugging Face one (for the MoE types, with experts per tensor as checkpoint
    files store them, or fused as transformers 5.x holds them in memory).

    Raises:
        ValueError: tensors missing from, or left over in, the Hugging Face state dict.
    """
    hf_state = {k: v for k, v in hf_state.items() if not k.endswith(_IGNORED_SUFFIXES)}
    adapter = _adapter(model_type, "state_from_hf")
    if isinstance(adapter, hf_moe.ExpertLayout):  # experts per tensor (checkpoint files) or fused (in memory)
        adapter = hf_moe.layout_of(hf_state, adapter)
    try:
        out = adapter.state_from_hf(hf_state, config)
    except KeyError as e:
        raise ValueError(f"checkpoint is missing tensor {e.args[0]!r} required by its config.json") from None
    used = set(adapter.state_to_hf(out, config))
    extra = sorted(set(hf_state) - used - ({"lm_head.weight"} if config.tie_word_embeddings else set()))
    if extra:
        raise ValueError(f"checkpoint holds tensors mg does not know: {extra[:5]}{'...' if len(extra) > 5 else ''}")
    return out


def state_to_hf(mg_state: dict[str, torch.Tensor], config: GPTConfig, model_type: str) -> dict[str, torch.Tensor]:
    """Hugging Face state dict from an unsharded mg one (drops RoPE buffers and the like)."""
    return _adapter(model_type, "state_to_hf").state_to_hf(mg_state, config)


def tensor_groups(config: GPTConfig, model_type: str) -> list[TensorGroup]:
    """The model as per-tensor conversion groups."""
    return _adapter(model_type, "tensor_groups").tensor_groups(config)


def is_ignored(name: str, config: GPTConfig) -> bool:
    """True for Hugging Face tensors that carry nothing mg needs (buffers, tied aliases)."""
    return name.endswith(_IGNORED_SUFFIXES) or (config.tie_word_embeddings and name == "lm_head.weight")
