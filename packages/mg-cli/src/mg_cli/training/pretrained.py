"""Starting a run from pretrained weights (``checkpoint.init_from``): a Hugging Face directory or an mg checkpoint.

Only the weights come over: the run starts at iteration 1 with a fresh optimizer, schedule and
data stream. The architecture is the pretrained model's (``model.*`` keys given override it, e.g.
``model.head: classification``). Every rank reads the whole pretrained model once (one process
model, unsharded; only where the run starts from it, not on resume) and copies its own tensor-parallel block of each parameter of its pipeline stage,
so a checkpoint of any layout, or a Hugging Face directory, starts any layout. Parameters the
pretrained model lacks (a new classification head) keep their initialisation; pretrained weights
this model does not use (an LM head under a classifier) are dropped; both are reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mg_cli.training.setup import TrainingError
from mg_parallel.grid import ProcessGrid


@dataclass
class Pretrained:
    """A pretrained model named by ``checkpoint.init_from``: its architecture, and its weights when first asked for
    (so the launcher's preflight and a resumed run, which need only the architecture, never read them)."""

    path: str
    family: str
    """The family's name (``model.type``), from the config's class."""
    config: Any
    """Its architecture (``GPTConfig``, ``BertConfig`` or ``T5Config``)."""
    _params: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """Every parameter, unsharded, by its mg name (a tied output weight appears once, as the embedding).

        Raises:
            TrainingError: the weights cannot be read (one line naming the path).
        """
        if self._params is None:
            from mg_ckpt import CheckpointError
            from mg_models import load_pretrained

            try:
                model = load_pretrained(self.path, dtype=torch.float32, device="cpu")
            except (OSError, ValueError, CheckpointError) as e:
                raise TrainingError(f"checkpoint.init_from: {str(e).splitlines()[0]}") from None
            self._params = {name: p.detach() for name, p in model.named_parameters()}
        return self._params


def read_pretrained(path: str) -> Pretrained:
    """The architecture of the model at ``path`` (Hugging Face directory or mg checkpoint of any family and
    layout), from its config and tensor names; the weights are read when :attr:`Pretrained.params` is first used.

    Raises:
        TrainingError: ``path`` is neither, or cannot be read (one line naming it).
    """
    from mg_ckpt import CheckpointError

    try:
        config = pretrained_config(path)
    except (OSError, ValueError, CheckpointError) as e:
        raise TrainingError(f"checkpoint.init_from: {str(e).splitlines()[0]}") from None
    from mg_models.family import family_of

    return Pretrained(path=path, family=family_of(config).name, config=config)


def pretrained_config(path: str) -> Any:
    """The model config of an mg checkpoint (its recorded config) or a Hugging Face directory (``config.json`` and
    the names of its tensors), the same :func:`mg_models.load_pretrained` builds the model from.

    Raises:
        FileNotFoundError: ``path`` is not a directory, or has neither ``config.json`` nor an mg checkpoint.
        ValueError, mg_ckpt.CheckpointError: an unsupported architecture, an unreadable checkpoint.
    """
    from mg_cli.checkpoints import config_from_state, is_mg_checkpoint

    if is_mg_checkpoint(path):
        from mg_ckpt import CheckpointReader

        reader = CheckpointReader(path, verify=False)
        return config_from_state(reader.extra, reader.path)
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"{path} is neither a Hugging Face model directory (no config.json) nor an mg "
                                f"checkpoint")
    from mg_ckpt import HFSafetensorsReader
    from mg_models.hf import read_hf_config

    reader = HFSafetensorsReader(str(path))
    return read_hf_config(path, reader.weight_map, reader.read)[0]


def architecture(pretrained: Pretrained, model_type: str) -> dict[str, Any]:
    """The pretrained model's config fields, for the run's model config to start from.

    Raises:
        TrainingError: the pretrained model is of another family than ``model.type``.
    """
    if pretrained.family != model_type:
        raise TrainingError(f"checkpoint.init_from: {pretrained.path} is a {pretrained.family.upper()} model but "
                            f"model.type={model_type}; set model.type: {pretrained.family}")
    return {k: v for k, v in pretrained.config.to_dict().items() if k != "vocab_size"}


def check_vocabulary(pretrained: Pretrained, vocab_size: int, tokenizer_path: str) -> None:
    """The run's tokenizer must be the pretrained model's (same vocabulary size).

    Raises:
        TrainingError: naming both sizes and the fix.
    """
    if pretrained.config.vocab_size != vocab_size:
        raise TrainingError(f"data.tokenizer_model: {tokenizer_path} has {vocab_size} tokens but the init_from model "
                            f"{pretrained.path} was trained with {pretrained.config.vocab_size}; use its tokenizer")


def load_weights(chunks: list[torch.nn.Module], grid: ProcessGrid, pretrained: Pretrained) -> str:
    """Copy this rank's block of every pretrained parameter into ``chunks`` (collective: one all-gather of names).

    Returns:
        The one-line report: tensors loaded, parameters initialised because the pretrained model lacks them,
        pretrained tensors no rank's model uses (dropped).

    Raises:
        TrainingError: a parameter whose global shape differs from the pretrained tensor's (names both).
    """
    from mg_cli.training.checkpointing import copy_from_unsharded

    try:
        used, fresh = copy_from_unsharded(chunks, grid, pretrained.params)
    except ValueError as e:
        raise TrainingError(f"checkpoint.init_from: {pretrained.path}: {e}; the model.* keys given change the "
                            f"architecture") from None
    everyone = [(sorted(used), fresh)]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(everyone, (sorted(used), fresh))
    used_anywhere = {k for keys, _ in everyone for k in keys}
    fresh_anywhere = sorted({k for _, names in everyone for k in names})
    dropped = sorted(set(pretrained.params) - used_anywhere)
    return (f"init_from {pretrained.path}: loaded {len(used_anywhere)} of {len(pretrained.params)} tensors"
            f"; initialised (not in the pretrained model): {', '.join(fresh_anywhere) or 'none'}"
            f"; dropped (unused by this model): {', '.join(dropped) or 'none'}")
