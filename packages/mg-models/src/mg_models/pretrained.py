"""``load_pretrained(path)``: a single-process model (GPT, BERT or T5) from a Hugging Face or mg checkpoint directory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mg_models.family import family_of

__all__ = [
    "CHECKPOINT_LOADER_GROUP",
    "MG_CHECKPOINT_LOADERS",
    "load_pretrained",
    "model_from_state",
    "register_checkpoint_loader",
]

CheckpointLoader = Callable[[Path], "tuple[Any, dict[str, torch.Tensor]] | None"]

CHECKPOINT_LOADER_GROUP = "mg_models.checkpoint_loaders"
"""Entry-point group of checkpoint loaders for formats mg does not read itself (mg checkpoints and Hugging Face
directories it does): a package declares its loader under this group, and :func:`load_pretrained` finds it
without anything being imported or registered first."""

MG_CHECKPOINT_LOADERS: list[CheckpointLoader] = []
"""Loaders of other checkpoint formats, tried in order: ``loader(path) -> (config, unsharded mg state) | None``
(None = not mine); the config is a GPTConfig, BertConfig or T5Config and picks the model class.
Holds those passed to :func:`register_checkpoint_loader`, then those of the
:data:`CHECKPOINT_LOADER_GROUP` entry points once :func:`load_pretrained` first needs them."""

_entry_point_errors: list[str] | None = None
"""None until the entry points are loaded; then one line per entry point that failed to load."""


def register_checkpoint_loader(loader: CheckpointLoader) -> None:
    """Add a loader for mg checkpoints (see :data:`MG_CHECKPOINT_LOADERS`); installed packages need not
    call this, their :data:`CHECKPOINT_LOADER_GROUP` entry points are found by :func:`load_pretrained`."""
    if loader not in MG_CHECKPOINT_LOADERS:
        MG_CHECKPOINT_LOADERS.append(loader)


def _discover_checkpoint_loaders() -> list[str]:
    """Load the :data:`CHECKPOINT_LOADER_GROUP` entry points into :data:`MG_CHECKPOINT_LOADERS` (the first time
    only); returns a one-line description of each that failed to load."""
    global _entry_point_errors
    if _entry_point_errors is None:
        from importlib.metadata import entry_points

        errors = []
        for ep in entry_points(group=CHECKPOINT_LOADER_GROUP):
            where = f"entry point {ep.name!r} = {ep.value!r} (group {CHECKPOINT_LOADER_GROUP!r})"
            try:
                loader = ep.load()
            except Exception as e:  # reported in one line, and only if no other loader opens the path
                first_line = (str(e).splitlines() or [""])[0]
                errors.append(f"{where} failed to load: {type(e).__name__}: {first_line}; reinstall the package "
                              f"that declares it")
                continue
            if not callable(loader):
                errors.append(f"{where} is not callable (a {type(loader).__name__} object)")
                continue
            register_checkpoint_loader(loader)
        _entry_point_errors = errors
    return _entry_point_errors


def model_from_state(config: Any, state: dict[str, torch.Tensor], *, dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None) -> torch.nn.Module:
    """A single-process model holding ``state`` (unsharded mg names), returning full unpadded logits.

    The config's family builds the model (:func:`mg_models.family.family_of`: a ``T5Config`` gives a T5Model,
    a ``BertConfig`` a BertModel, any other ``GPTConfig`` a GPTModel).

    Raises:
        ValueError: the state does not match the model (lists missing/unexpected keys), or no installed family
            builds the config.
    """
    return family_of(config).model_from_state(config, state, dtype=dtype, device=device)


def load_pretrained(path: str | Path, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> torch.nn.Module:
    """Load an mg checkpoint of any family (saved at any layout) or a Hugging Face directory (GPT-2, Llama, Mistral,
    Qwen, Mixtral, BERT, T5; safetensors) as a single-process model.

    The model runs in one process; ``model(input_ids [b, s])`` returns logits ``[b, s, vocab_size]``
    (unpadded), directly comparable with Hugging Face's. BERT and T5 give a
    :class:`~mg_models.bert.BertModel` (``model(input_ids, token_type_ids=None, attention_mask=None)
    -> (mlm_logits, binary_logits)``) or a :class:`~mg_models.t5.T5Model` (``model(input_ids,
    decoder_input_ids=..., attention_mask=None) -> (logits, encoder_output)``). A ``*ForSequenceClassification``
    directory gives the model with ``head="classification"``, returning logits ``[b, num_labels]``.

    Loaders of other checkpoint formats (:data:`MG_CHECKPOINT_LOADERS`, and those installed packages declare as
    :data:`CHECKPOINT_LOADER_GROUP` entry points) are tried first; mg checkpoints and Hugging Face directories are
    then read by :func:`mg_models.loading.load_model`.

    Raises:
        FileNotFoundError: ``path`` is not a directory.
        ValueError: an unsupported architecture, or a directory nothing recognises (naming any loader
            entry point that failed to load).
    """
    from mg_models.loading import is_mg_checkpoint, load_model

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory; pass a Hugging Face model directory or an mg checkpoint")
    broken = _discover_checkpoint_loaders()
    for loader in MG_CHECKPOINT_LOADERS:
        loaded = loader(path)
        if loaded is not None:
            config, state = loaded
            return model_from_state(config, state, dtype=dtype, device=device)
    if is_mg_checkpoint(path) or (path / "config.json").exists():
        try:
            return load_model(path, dtype=dtype, device=device, inference=True).model
        except ValueError as e:
            raise ValueError(f"{path}: {e}" if str(path) not in str(e) else str(e)) from None
    where = (f"; and no checkpoint loader recognises it: {'; '.join(broken)}" if broken else "")
    raise ValueError(f"{path}: neither a Hugging Face directory (no config.json) nor an mg checkpoint (an iter_* "
                     f"directory with metadata.json, or a save directory with latest){where}")
