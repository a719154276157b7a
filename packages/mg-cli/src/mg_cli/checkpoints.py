"""Whole-model access to mg training checkpoints (single process), for generate/convert/inspect.

Training checkpoints store each parameter as ``model/<name>`` with its global shape, so any
layout's checkpoint reads back as one unsharded state dict here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where tensors are made, so importing this module stays cheap
    import torch


def is_mg_checkpoint(path: str | os.PathLike[str]) -> bool:
    """True for an ``iter_*`` directory holding metadata.json or a save directory with ``latest``."""
    p = Path(path)
    return (p / "metadata.json").is_file() or (p / "latest").is_file()


def read_mg_checkpoint(path: str | os.PathLike[str], *, with_state: bool = True
                       ) -> tuple[Any, dict[str, torch.Tensor], dict[str, Any]]:
    """``(GPTConfig, unsharded model state, training state)`` of an mg checkpoint.

    Raises:
        mg_ckpt.CheckpointError: unreadable or corrupt checkpoint (names the file).
        ValueError: the checkpoint carries no model configuration (not written by ``mg train``/``mg convert``).
    """
    import torch

    from mg_ckpt import inspect_checkpoint, load_checkpoint
    from mg_models import GPTConfig

    report = inspect_checkpoint(str(path), verify=False)
    extra = report.state
    if "model_config" not in extra:
        raise ValueError(f"{report.path}: no model_config in the checkpoint state; it was not written by mg train/convert")
    config = GPTConfig.from_dict(extra["model_config"])
    state: dict[str, torch.Tensor] = {}
    if with_state:
        from mg_ckpt._io import torch_dtype

        template = {t.name: torch.empty(t.shape, dtype=torch_dtype(t.dtype, t.name))
                    for t in report.tensors if t.name.startswith("model/")}
        load_checkpoint(report.path, template)
        state = {k[len("model/"):]: v for k, v in template.items()}
        if config.tie_word_embeddings:
            state.pop("output_layer.weight", None)
    return config, state, extra


def _loader(path: Path) -> tuple[Any, dict[str, torch.Tensor]] | None:
    if not is_mg_checkpoint(path):
        return None
    config, state, _ = read_mg_checkpoint(path)
    return config, state


def register() -> None:
    """Let ``mg_models.load_pretrained`` open mg checkpoints."""
    from mg_models import register_checkpoint_loader

    register_checkpoint_loader(_loader)
