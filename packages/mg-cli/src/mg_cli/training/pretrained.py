"""Starting a run from pretrained weights (``checkpoint.init_from``): a Hugging Face directory or an mg checkpoint.

Only the weights come over: the run starts at iteration 1 with a fresh optimizer, schedule and
data stream. The architecture is the pretrained model's (``model.*`` keys given override it, e.g.
``model.head: classification``). Each rank reads its own block of each parameter of its pipeline stage (from an
mg checkpoint, only those pieces; a Hugging Face directory is read whole), the way every command gets a model
(:func:`mg_models.loading.fill_model`), so a checkpoint of any layout, or a Hugging Face directory, starts any
layout. Parameters the
pretrained model lacks (a new classification head) keep their initialisation; pretrained weights
this model does not use (an LM head under a classifier) are dropped; both are reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mg_cli.training.setup import TrainingError
from mg_parallel.grid import ProcessGrid


@dataclass
class Pretrained:
    """A pretrained model named by ``checkpoint.init_from``: its architecture; its weights are read when the run
    fills its model (:func:`load_weights`) or :attr:`params` is first used, so the launcher's preflight and a resumed
    run never read them."""

    path: str
    family: str
    """The family's name (``model.type``), from the config's class."""
    config: Any
    """Its architecture (the family's config class)."""
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
    layout), from its config and tensor names.

    Raises:
        TrainingError: ``path`` is neither, or cannot be read (one line naming it).
    """
    from mg_ckpt import CheckpointError
    from mg_models.family import family_of
    from mg_models.loading import source_config

    try:
        config, _ = source_config(path)
    except (OSError, ValueError, CheckpointError) as e:
        raise TrainingError(f"checkpoint.init_from: {str(e).splitlines()[0]}") from None
    return Pretrained(path=path, family=family_of(config).name, config=config)


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
    """Fill this rank's block of every pretrained parameter into ``chunks`` (:func:`mg_models.loading.fill_model`,
    not strict; collective: one all-gather of names).

    Returns:
        The one-line report: tensors loaded, parameters initialised because the pretrained model lacks them,
        pretrained tensors no rank's model uses (dropped).

    Raises:
        TrainingError: the weights cannot be read, or a parameter whose global shape differs from the pretrained
            tensor's (names both).
    """
    from mg_ckpt import CheckpointError
    from mg_models.loading import fill_model

    try:
        loaded = fill_model(chunks, grid, pretrained.path, strict=False)
    except ValueError as e:
        raise TrainingError(f"checkpoint.init_from: {pretrained.path}: {e}; the model.* keys given change the "
                            f"architecture") from None
    except (OSError, CheckpointError) as e:
        raise TrainingError(f"checkpoint.init_from: {str(e).splitlines()[0]}") from None
    everyone = [(sorted(loaded.used), loaded.missing)]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(everyone, (sorted(loaded.used), loaded.missing))
    used_anywhere = {k for keys, _ in everyone for k in keys}
    fresh_anywhere = sorted({k for _, names in everyone for k in names})
    dropped = sorted(loaded.source_names - used_anywhere)
    return (f"init_from {pretrained.path}: loaded {len(used_anywhere)} of {len(loaded.source_names)} tensors"
            f"; initialised (not in the pretrained model): {', '.join(fresh_anywhere) or 'none'}"
            f"; dropped (unused by this model): {', '.join(dropped) or 'none'}")
