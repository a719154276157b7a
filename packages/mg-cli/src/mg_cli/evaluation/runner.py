"""The model at its layout, behind the few calls evaluation needs.

A :class:`ModelRunner` holds one model replica (a whole model on one process, or this rank's
tensor-parallel shard) and answers ``logits``, ``classify`` and ``generate`` for a batch; every
tensor-parallel rank gets the same full-vocabulary results. ``map_examples`` deals examples to the
data-parallel ranks round-robin and gathers the results back in their original order, so every
rank ends with the same list whatever dp is.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from mg_models.family import ModelFamily, family_of
from mg_parallel.precision import Precision

__all__ = ["ModelRunner", "default_tokenizer", "load_model"]

T = TypeVar("T")
R = TypeVar("R")


def load_model(checkpoint: str | os.PathLike[str], *, precision: Precision | str | None = None,
               device: torch.device | str | None = None) -> tuple[torch.nn.Module, dict[str, Any]]:
    """``(single-process model, checkpoint state)`` of an mg checkpoint (any family and layout) or a Hugging
    Face directory (state ``{}``), built in ``precision`` (an ``mg_parallel.Precision`` or its name; None: the
    default dtype).

    Raises:
        FileNotFoundError, ValueError, mg_ckpt.CheckpointError: as :func:`mg_models.loading.load_model`.
    """
    from mg_models.loading import load_model as build_and_load

    loaded = build_and_load(checkpoint, precision=precision, device=device, inference=True)
    return loaded.model, loaded.extra


def default_tokenizer(checkpoint: str | os.PathLike[str], extra: dict[str, Any]) -> str | None:
    """The tokenizer an mg checkpoint records, else a ``tokenizer.json``/``tokenizer.model`` in a model directory."""
    if extra.get("tokenizer_model"):
        return str(extra["tokenizer_model"])
    for name in ("tokenizer.json", "tokenizer.model", "spiece.model"):
        if (Path(checkpoint) / name).is_file():
            return str(Path(checkpoint) / name)
    return None


def decoder_start_token_id(checkpoint: str | os.PathLike[str], extra: dict[str, Any]) -> int:
    """The id a T5 checkpoint's decoder starts from: what mg training recorded (the data's pad id), else a
    Hugging Face ``config.json``'s ``decoder_start_token_id``, else 0 (T5's own pad id)."""
    if extra.get("decoder_start_token_id") is not None:
        return int(extra["decoder_start_token_id"])
    cfg_file = Path(checkpoint) / "config.json"
    if cfg_file.is_file():
        start = json.loads(cfg_file.read_text()).get("decoder_start_token_id")
        if start is not None:
            return int(start)
    return 0


"""Default encoder input length of T5 models (the T5 paper's input length)."""


class ModelRunner:
    """One replica of a model (GPT, BERT or T5; whole, or this rank's tensor-parallel shard).

    Args:
        model: the model (pre_process and post_process on this rank).
        max_length: context length (tokens); default the config's ``max_position_embeddings`` (T5, whose
            relative positions have no such limit: :data:`mg_models.t5.family.T5_CONTEXT`).
        dp_group: the data-parallel process group (None: one replica, no collectives).
        decoder_start_token_id: T5's first decoder input (:func:`decoder_start_token_id`).
    """

    def __init__(self, model: torch.nn.Module, *, max_length: int | None = None, dp_group: Any = None,
                 decoder_start_token_id: int = 0) -> None:
        self.model = model.eval()
        self.decoder_start_token_id = decoder_start_token_id
        self.config = model.config
        self.max_length = int(max_length or self.family.context_length(self.config))
        self.dp_group = dp_group
        self.device = next(model.parameters()).device

    @property
    def family(self) -> ModelFamily:
        """The model's family (what it can be asked: log-likelihoods, classification, generation)."""
        return family_of(self.config)

    @torch.no_grad()
    def logits(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token logits ``[b, s, vocab_size]`` of a causal LM for right-padded ``ids [b, s]``; with a bool
        ``mask [b, s]`` only the logits of its n True positions, ``[n, vocab_size]`` in row-major order (the
        others are never projected onto the vocabulary).

        Raises:
            ValueError: the model is not a GPT-family language model.
        """
        self._check_lm()
        return self.model(ids, gather_logits=True, output_mask=mask)

    def _check_lm(self) -> None:
        if not self.family.is_language_model(self.config):
            raise ValueError(f"log-likelihood tasks need a GPT-family language model, not a {self.family.name} "
                             f"model with head {getattr(self.config, 'head', 'lm')!r}")

    @torch.no_grad()
    def classify(self, ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None
                 ) -> torch.Tensor:
        """Class logits ``[b, num_labels]`` of a classification-head model."""
        if getattr(self.config, "head", "lm") != "classification":
            raise ValueError("classification tasks need a model with a classification head (model.head="
                             "classification, or a Hugging Face *ForSequenceClassification directory)")
        return self.family.classify(self.model, ids, attention_mask, token_type_ids)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0, stop_token_ids: Sequence[int] = ()) -> list[list[int]]:
        """Generated ids of each prompt (GPT continues it; T5 decodes a target for it, from the decoder start
        id), with a KV cache."""
        from mg_models import SamplingConfig, generate, generate_seq2seq

        sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                  stop_token_ids=tuple(stop_token_ids))
        if self.family.kind == "encoder-decoder":
            return generate_seq2seq(self.model, prompts, sampling, decoder_start_token_id=self.decoder_start_token_id).tokens
        if self.family.kind == "encoder":
            raise ValueError(f"generation tasks need a GPT or T5 model; {self.family.name.upper()} is encoder-only")
        return generate(self.model, prompts, sampling).tokens

    # -- data parallelism ------------------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        return 0 if self.dp_group is None else torch.distributed.get_rank(self.dp_group)

    @property
    def dp_size(self) -> int:
        return 1 if self.dp_group is None else torch.distributed.get_world_size(self.dp_group)

    def map_examples(self, items: list[T], fn: Callable[[list[T]], list[R]]) -> list[R]:
        """``fn`` over ``items``: this dp rank takes items rank, rank + dp, ...; results come back in order on every rank."""
        if self.dp_size == 1:
            return fn(items)
        rank, size = self.dp_rank, self.dp_size
        local = fn(items[rank::size])
        gathered: list[Any] = [None] * size
        torch.distributed.all_gather_object(gathered, local, group=self.dp_group)
        out: list[Any] = [None] * len(items)
        for r, results in enumerate(gathered):
            out[r::size] = results
        return out
