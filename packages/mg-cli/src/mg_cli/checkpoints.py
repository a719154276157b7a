"""Whole-model access to mg training checkpoints (single process), for generate/convert/inspect.

Training checkpoints store each parameter as ``model/<name>`` with its global shape, so any
layout's checkpoint reads back as one unsharded state dict here. The model family comes from
``extra["model_family"]`` ("gpt", "bert" or "t5"; checkpoints without it are GPT) and its
configuration from ``extra["model_config"]``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where tensors are made, so importing this module stays cheap
    import torch

MODEL_PREFIX = "model/"
"""Prefix of the model parameters among a checkpoint's tensors."""


def is_mg_checkpoint(path: str | os.PathLike[str]) -> bool:
    """True for an ``iter_*`` directory holding metadata.json or a save directory with ``latest``."""
    p = Path(path)
    return (p / "metadata.json").is_file() or (p / "latest").is_file()


def model_family(extra: dict[str, Any]) -> str:
    """The model family recorded in a checkpoint's state ("gpt" when absent, as in older checkpoints)."""
    return str(extra.get("model_family", "gpt"))


def config_from_state(extra: dict[str, Any], where: str) -> Any:
    """The model config (GPTConfig, BertConfig or T5Config) recorded in a checkpoint's state.

    Raises:
        ValueError: no ``model_config`` (not written by ``mg train``/``mg convert``), an unknown
            family or config keys (naming ``where``).
    """
    from mg_models.hf import model_config_from_dict

    if "model_config" not in extra:
        raise ValueError(f"{where}: no model_config in the checkpoint state; it was not written by mg train/convert")
    try:
        return model_config_from_dict(model_family(extra), extra["model_config"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {str(e).splitlines()[0]}") from None


def read_model_state(reader: Any, config: Any, family: str) -> dict[str, torch.Tensor]:
    """Every ``model/`` tensor of an open :class:`mg_ckpt.CheckpointReader`, unsharded, without the prefix.

    Without what a one-process model of the family does not hold (a GPT with tied embeddings: the last pipeline
    stage's ``output_layer.weight``).

    Raises:
        mg_ckpt.CheckpointError: unreadable pieces (names the file).
    """
    names = [n for n in reader.specs if n.startswith(MODEL_PREFIX)]
    state = {k[len(MODEL_PREFIX):]: v for k, v in reader.read(names).items()}
    from mg_models.family import get_family

    for name in get_family(family).single_process_drops(config):
        state.pop(name, None)
    return state


def read_mg_checkpoint(path: str | os.PathLike[str], *, with_state: bool = True
                       ) -> tuple[Any, dict[str, torch.Tensor], dict[str, Any]]:
    """``(model config, unsharded model state, training state)`` of an mg checkpoint of any family.

    The metadata is read once; with ``with_state`` every ``model/`` tensor is assembled from its
    pieces (any layout), as :func:`read_model_state`.

    Raises:
        mg_ckpt.CheckpointError: unreadable or corrupt checkpoint (names the file).
        ValueError: the checkpoint carries no (or an unknown) model configuration.
    """
    from mg_ckpt import CheckpointReader

    reader = CheckpointReader(str(path), verify=False)
    extra = reader.extra
    config = config_from_state(extra, reader.path)
    state = read_model_state(reader, config, model_family(extra)) if with_state else {}
    return config, state, extra


def checkpoint_loader(path: Path) -> tuple[Any, dict[str, torch.Tensor]] | None:
    """``(model config, unsharded model state)`` of the mg checkpoint at ``path``, or None if it is not one.

    This is the ``mg`` entry point of the ``mg_models.checkpoint_loaders`` group (see mg-cli's
    pyproject.toml), through which ``mg_models.load_pretrained`` opens mg checkpoints of any family and
    layout without mg-models depending on mg-ckpt.

    Raises:
        mg_ckpt.CheckpointError: unreadable or corrupt checkpoint (names the file).
        ValueError: the checkpoint carries no (or an unknown) model configuration.
    """
    if not is_mg_checkpoint(path):
        return None
    config, state, _ = read_mg_checkpoint(path)
    return config, state
