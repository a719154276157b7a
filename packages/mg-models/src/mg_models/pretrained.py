"""``load_pretrained(path)``: a single-process model (GPT, BERT or T5) from a Hugging Face or mg checkpoint directory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mg_models.gpt import GPTModel
from mg_models.hf import read_hf_directory

__all__ = ["MG_CHECKPOINT_LOADERS", "load_pretrained", "model_from_state", "register_checkpoint_loader"]

CheckpointLoader = Callable[[Path], "tuple[Any, dict[str, torch.Tensor]] | None"]

MG_CHECKPOINT_LOADERS: list[CheckpointLoader] = []
"""Loaders for mg checkpoints, tried in order: ``loader(path) -> (config, unsharded mg state) | None``
(None = not mine); the config is a GPTConfig, BertConfig or T5Config and picks the model class.
mg-models cannot depend on mg-ckpt, so the CLI registers its reader here."""


def register_checkpoint_loader(loader: CheckpointLoader) -> None:
    """Add a loader for mg checkpoints (see :data:`MG_CHECKPOINT_LOADERS`)."""
    if loader not in MG_CHECKPOINT_LOADERS:
        MG_CHECKPOINT_LOADERS.append(loader)


def model_from_state(config: Any, state: dict[str, torch.Tensor], *, dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None) -> torch.nn.Module:
    """A single-process model holding ``state`` (unsharded mg names), returning full unpadded logits.

    The config's type picks the model: :class:`~mg_models.t5.T5Config` gives a T5Model,
    :class:`~mg_models.bert.BertConfig` a BertModel, any other GPTConfig a GPTModel.

    Raises:
        ValueError: the state does not match the model (lists missing/unexpected keys).
    """
    from mg_models.bert import BertConfig, BertModel
    from mg_models.t5 import T5Config, T5Model
    from mg_parallel.grid import ProcessGrid

    grid = ProcessGrid.single(torch.device(device) if device is not None else None)
    model: torch.nn.Module
    if isinstance(config, T5Config):
        model = T5Model(config, grid, dtype=dtype)
    elif isinstance(config, BertConfig):
        model = BertModel(config, grid, dtype=dtype)
    else:
        model = GPTModel(config, grid, dtype=dtype)
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(f"checkpoint does not match the model: missing {result.missing_keys[:5]}, "
                         f"unexpected {result.unexpected_keys[:5]}")
    model.gather_logits_default = True
    return model.eval()


def _load_hf_encoder_model(path: Path, dtype: torch.dtype | None,
                           device: torch.device | str | None) -> torch.nn.Module | None:
    """A BertModel / T5Model for a Hugging Face directory whose config.json says model_type bert / t5, else None."""
    import json

    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    if model_type == "bert":
        from mg_models.bert import load_hf_bert

        return load_hf_bert(path, dtype=dtype, device=device)
    if model_type == "t5":
        from mg_models.t5 import load_hf_t5

        return load_hf_t5(path, dtype=dtype, device=device)
    return None


def load_pretrained(path: str | Path, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> torch.nn.Module:
    """Load a Hugging Face directory (GPT-2, Llama, Mistral, BERT, T5; safetensors) or an mg checkpoint of any family.

    The model runs in one process; ``model(input_ids [b, s])`` returns logits ``[b, s, vocab_size]``
    (unpadded), directly comparable with Hugging Face's. BERT and T5 directories give a
    :class:`~mg_models.bert.BertModel` (``model(input_ids, token_type_ids=None, attention_mask=None)
    -> (mlm_logits, binary_logits)``) or a :class:`~mg_models.t5.T5Model` (``model(input_ids,
    decoder_input_ids=..., attention_mask=None) -> (logits, encoder_output)``).

    Raises:
        FileNotFoundError: ``path`` is not a directory.
        ValueError: an unsupported architecture, or a directory no loader recognises.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory; pass a Hugging Face model directory or an mg checkpoint")
    for loader in MG_CHECKPOINT_LOADERS:
        loaded = loader(path)
        if loaded is not None:
            config, state = loaded
            return model_from_state(config, state, dtype=dtype, device=device)
    if (path / "config.json").exists():
        encoder_model = _load_hf_encoder_model(path, dtype, device)
        if encoder_model is not None:
            return encoder_model
        config, state, _ = read_hf_directory(path)
        return model_from_state(config, state, dtype=dtype, device=device)
    raise ValueError(f"{path}: neither a Hugging Face directory (config.json) nor a checkpoint a registered mg "
                     f"loader recognises; for mg checkpoints call mg_models.register_checkpoint_loader first")
