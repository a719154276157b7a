"""Hugging Face checkpoint interoperability without importing ``transformers``.

A Hugging Face directory is ``config.json`` plus ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``). :func:`read_hf_directory` turns one into an mg config and an
unsharded mg state dict; :func:`write_hf_directory` writes the reverse with exactly Hugging Face's
tensor names (no separate tensor for tied weights) and a loadable ``config.json``.

For conversions that must not hold the model in memory, :func:`tensor_groups` describes any
supported model (GPT-2, Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE, BERT, T5) as small groups of tensors converted
independently (:mod:`mg_models.hf.groups`), and :func:`read_hf_config` reads a directory's
configuration from its ``config.json`` and, where needed, a tensor or two.

Every function dispatches on the Hugging Face ``model_type`` to the model family that reads it
(:func:`mg_models.family.family_for_hf`), whose adapter lives in the family's folder.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from mg_models.family import families, family_for_hf, family_of, get_family
from mg_models.hf.common import load_safetensors_dir, read_config_json, write_hf_files
from mg_models.hf.groups import TensorGroup, converted_specs, iter_converted

__all__ = ["TensorGroup", "config_from_hf", "config_to_hf", "converted_specs", "hf_model_types", "hf_tensor_ignored",
           "iter_converted", "model_config_from_dict", "read_hf_config", "read_hf_directory", "state_from_hf",
           "state_to_hf", "tensor_groups", "write_hf_directory"]


def hf_model_types() -> dict[str, str]:
    """Every Hugging Face ``model_type`` an installed family reads, with that family's name (the ``model_family``
    of mg checkpoints)."""
    return {t: f.name for f in families().values() for t in f.hf_model_types}


def _family(model_type: str, where: str) -> Any:
    try:
        return family_for_hf(model_type)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def config_from_hf(hf_config: dict[str, Any], where: str = "config.json", names: Collection[str] = (),
                   read: Callable[[str], torch.Tensor] | None = None) -> Any:
    """The mg config of a Hugging Face config dict (``names``/``read``: the directory's tensors, which a few
    architectures consult: BERT's pooler, T5's untied head).

    Raises:
        ValueError: an unsupported architecture or feature (names the config.json key).
    """
    model_type = hf_config.get("model_type", "")
    return _family(model_type, where).hf_config_from(hf_config, where, names, read)


def state_from_hf(hf_state: dict[str, torch.Tensor], config: Any, model_type: str) -> dict[str, torch.Tensor]:
    """Unsharded mg state dict from a Hugging Face one.

    Raises:
        ValueError: tensors missing from, or left over in, the Hugging Face state dict.
    """
    return _family(model_type, "state_from_hf").hf_state_from(hf_state, config, model_type)


def state_to_hf(mg_state: dict[str, torch.Tensor], config: Any, model_type: str) -> dict[str, torch.Tensor]:
    """Hugging Face state dict from an unsharded mg one."""
    return _family(model_type, "state_to_hf").hf_state_to(mg_state, config, model_type)


def read_hf_directory(path: str | Path) -> tuple[Any, dict[str, torch.Tensor], str]:
    """Read a Hugging Face model directory -> (mg config, unsharded mg state dict, model_type).

    Raises:
        FileNotFoundError: no config.json or safetensors weights.
        ValueError: unsupported architecture or mismatched tensors (message names the file/key).
    """
    path = Path(path)
    cfg_file, hf_config = read_config_json(path)
    model_type = hf_config.get("model_type", "")
    family = _family(model_type, str(cfg_file))
    family.hf_config_from(hf_config, str(cfg_file), (), None)  # config errors first, before reading weights
    state = load_safetensors_dir(path)
    config = family.hf_config_from(hf_config, str(cfg_file), state.keys(), state.__getitem__)
    return config, family.hf_state_from(state, config, model_type), model_type


def write_hf_directory(path: str | Path, mg_state: dict[str, torch.Tensor], config: Any,
                       model_type: str | None = None, extra_config: dict[str, Any] | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` that ``transformers`` loads (``AutoModelForCausalLM``,
    ``AutoModelForSequenceClassification`` for a classification head, which needs ``pad_token_id`` in
    ``extra_config`` for batches of several sequences, ``BertForPreTraining``, ``T5ForConditionalGeneration``).

    ``mg_state`` is an unsharded mg state dict (e.g. ``GPTModel(...).state_dict()`` at tp=1); ``model_type`` is
    one the config's family writes ("gpt2", "llama", "mistral", "qwen2", "qwen3" or, for a model with MoE layers,
    "mixtral", "qwen2_moe" or "qwen3_moe"; "bert"; "t5"), by default the family's (GPT: "llama");
    ``extra_config`` adds keys such as token ids.
    """
    family = family_of(config)
    model_type = model_type or family.hf_model_type(config)
    hf_config = family.hf_config_to(config, model_type)
    hf_config.update(extra_config or {})
    return write_hf_files(path, family.hf_state_to(mg_state, config, model_type), hf_config)


def model_config_from_dict(family: str, d: dict[str, Any]) -> Any:
    """The model config of mg family ``family`` (e.g. "gpt", "bert", "t5") from its ``to_dict()`` form.

    Raises:
        ValueError: an unknown family or unknown config keys.
    """
    return get_family(family).config_from_dict(d)


def tensor_groups(config: Any, model_type: str) -> list[TensorGroup]:
    """The model as per-tensor conversion groups (see :mod:`mg_models.hf.groups`).

    Raises:
        ValueError: an unsupported ``model_type``.
    """
    return _family(model_type, "tensor_groups").hf_tensor_groups(config, model_type)


def config_to_hf(config: Any, model_type: str) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dict of ``config`` exported as ``model_type``.

    Raises:
        ValueError: an unsupported ``model_type`` or a config the architecture cannot express.
    """
    return _family(model_type, "config_to_hf").hf_config_to(config, model_type)


def hf_tensor_ignored(name: str, config: Any, model_type: str) -> bool:
    """True for Hugging Face tensors that carry nothing mg needs (buffers, tied aliases)."""
    return _family(model_type, "hf_tensor_ignored").hf_tensor_ignored(name, config, model_type)


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
    return _family(model_type, str(cfg_file)).hf_config_from(hf_config, str(cfg_file), names, read), model_type
