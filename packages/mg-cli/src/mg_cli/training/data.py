"""Training and validation data for a run: datasets, the layout-independent sampler, micro-batches.

Sample order is a function of (seed, data, global batch size) only: global batch ``k`` holds the
same samples at any tp/pp/cp/dp, and a run resumed at iteration ``n`` continues from global batch
``n`` (``consumed_samples = n * global_batch_size``). Context-parallel ranks are not data-parallel:
the ranks of a cp group read the same samples and each keeps its load-balanced part of every
``[b, s]`` tensor (chunks ``r`` and ``2cp-1-r``, ``mg_parallel.context_parallel.split_for_cp``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch

from mg_cli.config import ConfigError, RunConfig
from mg_cli.training.setup import TrainingError
from mg_data import (
    BertDatasetConfig,
    ClassificationDatasetConfig,
    GlobalBatchSampler,
    GPTDatasetConfig,
    NotSentenceSplitError,
    Seq2SeqDatasetConfig,
    SFTDatasetConfig,
    T5DatasetConfig,
    build_bert_datasets,
    build_classification_datasets,
    build_gpt_datasets,
    build_seq2seq_datasets,
    build_sft_datasets,
    build_t5_datasets,
)
from mg_data.torch_adapter import build_data_loader
from mg_parallel.context_parallel import split_for_cp
from mg_parallel.grid import ProcessGrid


def dataset_config(config: RunConfig, tokenizer: Any, cache_dir: str | None) -> Any:
    """The sample-dataset config of ``model.type`` and ``data.format`` (GPT tokens, BERT sentence pairs, T5 span
    corruption, SFT conversations, labelled or input -> target examples): the ``data.*`` keys given (fields of the
    family's dataset config class, same names) and what the run fills in (lengths and special-token ids, as the
    family says, the seed, the cache).

    Raises:
        TrainingError: a ``data.*`` key of another family, the tokenizer lacks a special token the family
            needs, or a bad length.
    """
    from mg_cli.training.families import family, special_tokens

    t, m = config.train, config.model
    try:
        cls = config.family_class("data")
    except ConfigError as e:
        raise TrainingError(str(e)) from None
    ids = special_tokens(config, tokenizer, cls)
    run: dict[str, Any] = {"seed": t.seed, "cache_dir": cache_dir}
    run.update(family(config).dataset_fields(config.data.format, ids, seq_length=m.seq_length,
                                             decoder_seq_length=m.decoder_seq_length,
                                             vocab_size=tokenizer.vocab_size))
    try:
        return config.make(cls, **run)
    except ValueError as e:
        raise TrainingError(f"model.seq_length / model.decoder_seq_length / data: {e}") from None


_BUILDERS = {GPTDatasetConfig: build_gpt_datasets, BertDatasetConfig: build_bert_datasets,
             T5DatasetConfig: build_t5_datasets, SFTDatasetConfig: build_sft_datasets,
             ClassificationDatasetConfig: build_classification_datasets, Seq2SeqDatasetConfig: build_seq2seq_datasets}
"""Train/valid/test datasets of each dataset config class."""
_EXAMPLES = (ClassificationDatasetConfig, Seq2SeqDatasetConfig)
"""Example datasets: they read .jsonl files too (with the tokenizer)."""


def build_datasets(config: RunConfig, ds_config: Any, tokenizer: Any, wanted: tuple[int | None, ...]) -> list[Any]:
    """Train/valid/test datasets of ``ds_config``'s class (or of its nearest base that has a builder).

    Raises:
        TrainingError: unusable data (names the key and the file or line).
    """
    d = config.data
    blend = d.path if isinstance(d.path, list) else [d.path]
    cls = next(k for k in type(ds_config).__mro__ if k in _BUILDERS)
    extra: dict[str, Any] = {}
    if cls in _EXAMPLES:
        extra["tokenizer"] = tokenizer
    if d.valid_path is not None:  # the fine-tuning formats' own validation set, used whole
        extra["blend_per_split"], blend = [blend, [d.valid_path], None], None
    try:
        return _BUILDERS[cls](ds_config, blend, wanted, **extra)
    except NotSentenceSplitError as e:
        raise TrainingError(f"data.path: {e}; make one with `mg preprocess --split-sentences ...` and set "
                            f"data.path to its PREFIX_text_sentence output") from None
    except ValueError as e:
        raise TrainingError(f"data.path: {e}") from None


def run_datasets(config: RunConfig, tokenizer: Any) -> tuple[Any, list[Any]]:
    """``(dataset config, [train, valid, test])`` of the run: as many samples as ``train.iters`` steps and every
    validation of ``eval`` need, cached next to the (last) data file unless ``data.cache_dir`` says where.

    Raises:
        TrainingError: unusable data (names the key and the file or line).
    """
    d, t = config.data, config.train
    blend = d.path if isinstance(d.path, list) else [d.path]
    cache = d.cache_dir or os.path.join(os.path.dirname(os.path.abspath(str(blend[-1]))), "index-cache")
    gbs = t.global_batch_size
    evals = (t.iters // config.eval.interval if config.eval.interval else 0) + 1
    wanted = (t.iters * gbs, config.eval.iters * gbs * evals, None)
    ds_config = dataset_config(config, tokenizer, cache)
    return ds_config, build_datasets(config, ds_config, tokenizer, wanted)


def task_labels(datasets: list[Any]) -> tuple[list[str] | None, int]:
    """``(label names or None for integer labels, number of labels)`` of a classification run's datasets."""
    train = datasets[0]
    return (None if train.label_names is None else list(train.label_names)), int(train.num_labels)


class RunData:
    """Train/valid datasets and per-rank micro-batch iterators.

    ``built``: what :func:`run_datasets` returned for this config, when the checks before the run built it
    already (the classification format reads its labels from it); otherwise it is built here.
    """

    def __init__(self, config: RunConfig, grid: ProcessGrid, tokenizer: Any,
                 built: tuple[Any, list[Any]] | None = None) -> None:
        d, t = config.data, config.train
        self.config = config
        self.grid = grid
        gbs = t.global_batch_size
        self.ds_config, (self.train_ds, self.valid_ds, _) = built or run_datasets(config, tokenizer)
        if self.train_ds is None:
            raise TrainingError(f"data.split={d.split!r} gives the training split no documents; raise its weight")
        if len(self.train_ds) < gbs:
            raise TrainingError(f"the training split has {len(self.train_ds)} samples, fewer than one global batch "
                                f"({gbs}); use more data or a smaller train.global_batch_size")
        self.micro_batches_per_step = gbs // (t.micro_batch_size * grid.dp_size)

    def _loader(self, dataset: Any, consumed_samples: int, batch_size: int, workers: int) -> Iterator[dict[str, torch.Tensor]]:
        sampler = GlobalBatchSampler(
            total_samples=len(dataset), global_batch_size=batch_size,
            micro_batch_size=self.config.train.micro_batch_size, dp_rank=self.grid.dp_rank,
            dp_size=self.grid.dp_size, consumed_samples=consumed_samples,
        )
        loader = build_data_loader(dataset, sampler, num_workers=workers,
                                   pin_memory=self.grid.device.type == "cuda")
        device, grid = self.grid.device, self.grid
        for batch in loader:
            if grid.cp_size > 1:  # every cp rank gets the same samples and keeps its load-balanced part of each
                batch = {k: split_for_cp(v, grid.cp_rank, grid.cp_size, seq_dim=1) for k, v in batch.items()}
            yield {k: v.to(device, non_blocking=True) for k, v in batch.items()}

    def train_iterator(self, consumed_samples: int) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's training micro-batches from ``consumed_samples`` on, endlessly (wrapping epochs).

        ``len(train_ds)`` covers the samples the run needs, so wrapping only happens when a run is
        extended beyond the iterations its index was built for.
        """
        gbs = self.config.train.global_batch_size
        total = (len(self.train_ds) // gbs) * gbs
        consumed = consumed_samples % total
        while True:
            yield from self._loader(self.train_ds, consumed, gbs, self.config.data.num_workers)
            consumed = 0

    def valid_batches(self) -> list[dict[str, torch.Tensor]] | None:
        """The first ``eval.iters`` global batches of the validation split (the same every evaluation)."""
        if self.valid_ds is None or self.config.eval.iters < 1:
            return None
        gbs = self.config.train.global_batch_size
        steps = min(self.config.eval.iters, len(self.valid_ds) // gbs)
        if steps < 1:
            return None
        it = self._loader(self.valid_ds, 0, gbs, 0)
        return [next(it) for _ in range(steps * self.micro_batches_per_step)]
