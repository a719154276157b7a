"""Process start-up for a training run: threads and checks before any collective (the job itself: mg_cli.job).

Every check here uses only the config, the environment and the files, so every rank reaches the
same verdict and fails with the same one-line message before the first collective (no rank is
left waiting on one that exited).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from mg_cli.config import RunConfig
from mg_cli.job import Env


class TrainingError(RuntimeError):
    """A user-facing training failure with a one-line message naming the cause and the fix."""


@dataclass
class Plan:
    """What the checks before any collective resolved, for building the run."""

    dims: Any
    """The layout (``mg_parallel.ParallelDims``, dp resolved for this world size)."""
    tokenizer: Any
    model_config: Any
    """The architecture (``GPTConfig``, ``BertConfig`` or ``T5Config``)."""
    schedule: Any
    """The learning rate by iteration (``LRSchedule``)."""
    precision: Any
    """The precision policy (``mg_parallel.Precision``) of ``train.precision`` and the loss-scaling keys, made once
    here and passed to what builds, wraps and steps the model."""
    pretrained: Any = None
    """``checkpoint.init_from``'s model (``mg_cli.training.pretrained.Pretrained``), or None."""
    labels: tuple[list[str] | None, int] | None = None
    """Classification: (label names, or None for integer labels; number of labels)."""
    tasks: list[Any] = field(default_factory=list)
    """``eval.tasks`` parsed (``mg_cli.evaluation.TaskSpec``)."""
    datasets: Any = None
    """The run's ``(dataset config, [train, valid, test])`` when the checks built them (classification), else
    None (the run builds them)."""


def set_threads(config: RunConfig, env: Env) -> int:
    """Intra-op threads: ``train.threads`` or the cores shared evenly among this node's processes."""
    threads = config.train.threads or max(1, (os.cpu_count() or 1) // max(1, env.local_world_size))
    torch.set_num_threads(threads)
    return threads


def check_config(config: RunConfig, env: Env) -> Any:
    """Checks that need no collective: the layout for this world size, batch sizes, data files, checkpoints.

    Returns:
        The resolved ``mg_parallel.ParallelDims`` (dp derived here, the one place).

    Raises:
        TrainingError: naming the key or file at fault.
    """
    from mg_parallel.grid import ParallelDims

    t = config.train
    try:
        dims = config.make(ParallelDims).resolve(env.world_size)
    except ValueError as e:
        raise TrainingError(str(e)) from None
    check_context_parallel_run(config, dims)
    check_fsdp_run(config, dims)
    if t.global_batch_size % (t.micro_batch_size * dims.dp):
        raise TrainingError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by train.micro_batch_size * dp = "
            f"{t.micro_batch_size} * {dims.dp}; with {env.world_size} processes and tp*pp={dims.tp * dims.pp}, "
            f"dp={dims.dp}"
        )
    num_micro = t.global_batch_size // (t.micro_batch_size * dims.dp)
    if dims.vpp > 1 and num_micro % dims.pp:
        raise TrainingError(
            f"the interleaved schedule (parallel.vpp={dims.vpp}) needs micro-batches per step ({num_micro}) to be a "
            f"multiple of parallel.pp={dims.pp}; change train.global_batch_size or train.micro_batch_size"
        )
    if dims.sequence_parallel and (config.model.seq_length // dims.cp) % dims.tp:
        per_rank = f" / parallel.cp={dims.cp} = {config.model.seq_length // dims.cp}" if dims.cp > 1 else ""
        raise TrainingError(
            f"model.seq_length={config.model.seq_length}{per_rank} is not divisible by parallel.tp={dims.tp}, which "
            f"parallel.sequence_parallel needs"
        )
    check_files(config)
    return dims


def resolve_precision(config: RunConfig) -> Any:
    """The run's precision policy (``mg_parallel.Precision``) from ``train.precision`` and the loss-scaling keys:
    the one place the key becomes dtypes, a GEMM recipe and a loss scaler.

    Raises:
        TrainingError: bf16 on a GPU without bf16 support.
    """
    from mg_parallel.optimizer import OptimizerConfig

    try:
        precision = config.make(OptimizerConfig).precision_policy()
    except ValueError as e:
        raise TrainingError(str(e)) from None
    if precision.param_dtype == torch.bfloat16 and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        raise TrainingError(f"train.precision={precision.name} but this GPU has no bf16 support; use fp16 or fp32")
    return precision


def check_fsdp_run(config: RunConfig, dims: Any) -> None:
    """``parallel.fsdp``: its keys agree, it is not combined with the distributed optimizer, the shard size divides
    dp x cp, and nothing else in the run needs every data-parallel rank to run the model separately.

    Raises:
        TrainingError: naming the key at fault.
    """
    from mg_parallel.distributed.fsdp_mesh import FSDPConfig, check_fsdp

    p = config.parallel
    try:
        fsdp = config.make(FSDPConfig)
        check_fsdp(dims.dp, fsdp=fsdp.fsdp, use_distributed_optimizer=p.use_distributed_optimizer,
                   shard_size=fsdp.fsdp_shard_size, cp=dims.cp)
    except ValueError as e:
        raise TrainingError(str(e)) from None
    if fsdp.fsdp and config.eval.tasks:
        # Each data-parallel rank scores its own requests, but FSDP gathers parameters collectively.
        raise TrainingError("eval.tasks are not supported with parallel.fsdp; leave eval.tasks empty and run "
                            "`mg eval` on the checkpoint")


def check_context_parallel_run(config: RunConfig, dims: Any) -> None:
    """What ``parallel.cp > 1`` needs of the run: a model whose family supports it (GPT) on token data (pretrain or sft) whose ``seq_length``
    splits into ``2 * cp`` chunks, and no ``eval.tasks`` (they score unsplit sequences).

    Raises:
        TrainingError: naming the key at fault.
    """
    cp, m = dims.cp, config.model
    if cp == 1:
        return
    from mg_models.family import families, get_family

    if not get_family(m.type).supports_context_parallel:
        users = "/".join(f.name for f in families().values() if f.supports_context_parallel)
        raise TrainingError(f"parallel.cp={cp}: context parallelism is only supported for model.type={users} for now "
                            f"(not {m.type}); set parallel.cp: 1")
    if config.data.format not in ("pretrain", "sft"):
        raise TrainingError(f"parallel.cp={cp} is not supported with data.format={config.data.format} (a "
                            f"classification head reads whole sequences); set parallel.cp: 1")
    if config.eval.tasks:
        raise TrainingError(f"eval.tasks are not supported with parallel.cp={cp}; leave eval.tasks empty and run "
                            f"`mg eval` on the checkpoint")
    if m.seq_length % (2 * cp):
        raise TrainingError(
            f"model.seq_length={m.seq_length} is not divisible by 2 * parallel.cp = {2 * cp} (each context-parallel "
            f"rank holds two of 2*cp equal chunks); choose a seq_length that is a multiple of {2 * cp}"
        )


def check_files(config: RunConfig) -> None:
    """The tokenizer, dataset and checkpoint files the config names exist and are readable.

    Raises:
        TrainingError: naming the key and the file.
    """
    d = config.data
    if d.path is None:
        raise TrainingError("data.path is not set; point it at a dataset prefix made by `mg preprocess`")
    if d.tokenizer_model is None:
        raise TrainingError("data.tokenizer_model is not set; point it at the tokenizer used by `mg preprocess`")
    if not os.path.isfile(d.tokenizer_model):
        raise TrainingError(f"data.tokenizer_model: {d.tokenizer_model} does not exist")
    paths = d.path if isinstance(d.path, list) else [d.path]
    _check_dataset("data.path", d.format, paths)
    if d.valid_path is not None:
        if d.format == "pretrain":
            raise TrainingError("data.valid_path is for the fine-tuning formats (sft, classification, seq2seq); "
                                "pretraining validates on a data.split share of data.path")
        _check_dataset("data.valid_path", d.format, [d.valid_path])
    c = config.checkpoint
    if c.load is not None and not os.path.exists(c.load):
        raise TrainingError(f"checkpoint.load: {c.load} does not exist")


_FIELDS = {"sft": ("text", "loss_mask"), "classification": ("text", "label"), "seq2seq": ("input", "target")}
"""The indexed datasets `mg preprocess --format F` writes for one output prefix (PREFIX_{field}_document)."""


def _check_dataset(key: str, data_format: str, blend: list[Any]) -> None:
    """Every dataset file of ``blend`` exists and has a readable header (a .jsonl file for the example formats).

    Raises:
        TrainingError: naming ``key`` and the missing or malformed file.
    """
    from mg_data import IndexedDataset, IndexedDatasetError, parse_blend

    try:
        prefixes, _ = parse_blend(blend)
    except ValueError as e:
        raise TrainingError(f"{key}: {e}") from None
    if data_format in ("classification", "seq2seq") and len(prefixes) == 1 and os.path.isfile(prefixes[0]):
        return  # a JSONL file, read (and its lines checked) when the datasets are built
    if data_format in _FIELDS:
        from mg_data.finetune import field_prefix

        fields = _FIELDS[data_format]
        prefixes = [field_prefix(p, f, fields) for p in prefixes for f in fields]
    for prefix in prefixes:
        if not (os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")):
            raise TrainingError(
                f"{key}: {prefix}.bin/.idx not found; give the prefix `mg preprocess` printed "
                f"(e.g. data/corpus_text_document)"
            )
        try:
            IndexedDataset(prefix)  # header and size consistency; full verification is `mg inspect`
        except IndexedDatasetError as e:
            raise TrainingError(f"{key}: {e}") from None
