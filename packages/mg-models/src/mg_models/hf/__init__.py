"""Hugging Face checkpoint interoperability without importing ``transformers``.

A Hugging Face directory is ``config.json`` plus ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``). :func:`read_hf_directory` turns one into an mg config and an
unsharded mg state dict; :func:`write_hf_directory` writes the reverse with exactly Hugging Face's
tensor names (no separate tensor for tied weights) and a loadable ``config.json``.

For conversions that must not hold the model in memory, :func:`tensor_groups` describes any
supported model (GPT-2, Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE, BERT, T5) as small groups of tensors converted
independently (:mod:`mg_models.hf.groups`), and :func:`read_hf_config` reads a directory's
configuration from its ``config.json`` and, where needed, a tensor or two.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from mg_models.config import GPTConfig
from mg_models.hf import gpt2, llama, moe
from mg_models.hf.common import load_safetensors_dir, read_config_json, write_hf_files
from mg_models.hf.groups import TensorGroup, converted_specs, iter_converted

__all__ = ["FAMILY_OF_MODEL_TYPE", "SUPPORTED_MODEL_TYPES", "TensorGroup", "config_from_hf", "config_to_hf",
           "converted_specs", "hf_tensor_ignored", "iter_converted", "model_config_from_dict", "read_hf_config",
           "read_hf_directory", "state_from_hf", "state_to_hf", "tensor_groups", "write_hf_directory"]

SUPPORTED_MODEL_TYPES = {"gpt2": gpt2, "llama": llama, "mistral": llama, "qwen2": llama, "qwen3": llama,
                         "mixtral": moe.MIXTRAL, "qwen2_moe": moe.QWEN_MOE, "qwen3_moe": moe.QWEN_MOE}
"""The GPT-family Hugging Face architectures (BERT and T5 have their own modules)."""
FAMILY_OF_MODEL_TYPE = {**dict.fromkeys(SUPPORTED_MODEL_TYPES, "gpt"), "bert": "bert", "t5": "t5"}
"""mg model family (``extra["model_family"]`` of mg checkpoints) of each Hugging Face ``model_type``."""
# Non-parameter buffers some GPT-2 checkpoints carry (the causal mask); safe to drop.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def _adapter(model_type: str, where: str) -> Any:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{where}: model_type={model_type!r} is not supported; supported: "
                         f"{sorted(SUPPORTED_MODEL_TYPES)}")
    return SUPPORTED_MODEL_TYPES[model_type]


def config_from_hf(hf_config: dict[str, Any], where: str = "config.json") -> GPTConfig:
    """GPTConfig from a Hugging Face config dict. Raises ValueError for unsupported models/features."""
    return _adapter(hf_config.get("model_type", ""), where).config_from_hf(hf_config)


def state_from_hf(hf_state: dict[str, torch.Tensor], config: GPTConfig, model_type: str) -> dict[str, torch.Tensor]:
    """Unsharded mg state dict from a Hugging Face one (for the MoE types, with experts per tensor as checkpoint
    files store them, or fused as transformers 5.x holds them in memory).

    Raises:
        ValueError: tensors missing from, or left over in, the Hugging Face state dict.
    """
    hf_state = {k: v for k, v in hf_state.items() if not k.endswith(_IGNORED_SUFFIXES)}
    adapter = _adapter(model_type, "state_from_hf")
    if isinstance(adapter, moe.ExpertLayout):  # experts per tensor (checkpoint files) or fused (in memory)
        adapter = moe.layout_of(hf_state, adapter)
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


def read_hf_directory(path: str | Path) -> tuple[GPTConfig, dict[str, torch.Tensor], str]:
    """Read a Hugging Face model directory -> (mg config, unsharded mg state dict, model_type).

    Raises:
        FileNotFoundError: no config.json or safetensors weights.
        ValueError: unsupported architecture or mismatched tensors (message names the file/key).
    """
    path = Path(path)
    cfg_file, hf_config = read_config_json(path)
    model_type = hf_config.get("model_type", "")
    config = config_from_hf(hf_config, where=str(cfg_file))
    return config, state_from_hf(load_safetensors_dir(path), config, model_type), model_type


def write_hf_directory(path: str | Path, mg_state: dict[str, torch.Tensor], config: GPTConfig,
                       model_type: str = "llama", extra_config: dict[str, Any] | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` loadable by ``AutoModelForCausalLM.from_pretrained`` (by
    ``AutoModelForSequenceClassification`` for the classification head, which needs ``pad_token_id`` in
    ``extra_config`` for batches of several sequences).

    ``mg_state`` is an unsharded mg state dict (e.g. ``GPTModel(...).state_dict()`` at tp=1);
    ``model_type`` is "gpt2", "llama", "mistral", "qwen2", "qwen3" or, for a model with MoE layers, "mixtral",
    "qwen2_moe" or "qwen3_moe"; ``extra_config`` adds keys such as token ids.
    """
    adapter = _adapter(model_type, "write_hf_directory")
    hf_config = adapter.config_to_hf(config) if model_type == "gpt2" else adapter.config_to_hf(config, model_type)
    hf_config.update(extra_config or {})
    return write_hf_files(path, state_to_hf(mg_state, config, model_type), hf_config)


def _family_module(model_type: str, where: str) -> Any:
    if model_type == "bert":
        from mg_models.hf import bert

        return bert
    if model_type == "t5":
        from mg_models.hf import t5

        return t5
    return _adapter(model_type, where)


def model_config_from_dict(family: str, d: dict[str, Any]) -> Any:
    """The model config of mg family ``family`` ("gpt", "bert", "t5") from its ``to_dict()`` form.

    Raises:
        ValueError: an unknown family or unknown config keys.
    """
    if family == "gpt":
        return GPTConfig.from_dict(d)
    if family == "bert":
        from mg_models.bert import BertConfig

        return BertConfig.from_dict(d)
    if family == "t5":
        from mg_models.t5 import T5Config

        return T5Config.from_dict(d)
    raise ValueError(f"model_family={family!r} is not known; expected 'gpt', 'bert' or 't5'")


def tensor_groups(config: Any, model_type: str) -> list[TensorGroup]:
    """The model as per-tensor conversion groups (see :mod:`mg_models.hf.groups`).

    Raises:
        ValueError: an unsupported ``model_type``.
    """
    return _family_module(model_type, "tensor_groups").tensor_groups(config)


def config_to_hf(config: Any, model_type: str) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dict of ``config`` exported as ``model_type``.

    Raises:
        ValueError: an unsupported ``model_type`` or a config the architecture cannot express.
    """
    module = _family_module(model_type, "config_to_hf")
    typed = model_type in SUPPORTED_MODEL_TYPES and model_type != "gpt2"  # one adapter serves several types
    return module.config_to_hf(config, model_type) if typed else module.config_to_hf(config)


def hf_tensor_ignored(name: str, config: Any, model_type: str) -> bool:
    """True for Hugging Face tensors that carry nothing mg needs (buffers, tied aliases)."""
    if model_type == "bert":
        from mg_models.hf import bert

        return bert.is_ignored(name)
    if model_type == "t5":
        from mg_models.hf import t5

        return t5.is_ignored(name, config)
    return name.endswith(_IGNORED_SUFFIXES) or (config.tie_word_embeddings and name == "lm_head.weight")


def read_hf_config(path: str | Path, names: Collection[str],
                   read: Callable[[str], torch.Tensor]) -> tuple[Any, str]:
    """``(mg config, model_type)`` of a Hugging Face directory, from ``config.json`` and its tensor names.

    ``names`` are the tensors the directory holds; ``read(name)`` reads one. BERT's binary head is
    present when the pooler is; T5's head is untied when ``lm_head.weight`` differs from the shared
    embedding (the only case where two tensors are read).

    Raises:
        FileNotFoundError: no config.json.
        ValueError: an unsupported architecture or feature (names the config.json key).
    """
    cfg_file, hf_config = read_config_json(Path(path))
    model_type = hf_config.get("model_type", "")
    if model_type == "bert":
        from mg_models.hf import bert

        if "bert.pooler.dense.weight" not in names:
            hf_config = {**hf_config, "architectures": ["BertForMaskedLM"]}
        return bert.config_from_hf(hf_config, str(cfg_file)), model_type
    if model_type == "t5":
        from mg_models.hf import t5

        t5.config_from_hf(hf_config, str(cfg_file))  # config errors before reading weights
        untied = "lm_head.weight" in names and not torch.equal(read("lm_head.weight"), read("shared.weight"))
        return t5.config_from_hf(hf_config, str(cfg_file), has_lm_head=untied), model_type
    return config_from_hf(hf_config, where=str(cfg_file)), model_type
