"""What each section of the run configuration is made of: library dataclasses, plus mg train's own keys.

A section's keys are the fields of the library dataclasses listed for it (same names, same
defaults, the field docstrings as help), followed by the keys only ``mg train`` has (paths, the
loop, logging), which are the small dataclasses below. A field added to a library dataclass is
therefore a key without any change here; the lists below only name the fields a run fills in
itself (the vocabulary from the tokenizer, special-token ids, the world size) and which section a
class's fields go to when they are spread over several.

This module imports no torch: library classes are named as ``"module:Class"`` and imported when a
configuration is first read, so ``mg --help`` stays instant.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from mg_cli.schema import ConfigError, Schema, SectionSpec, Source
from mg_models.family import families


@dataclass(kw_only=True)
class ModelKeys:
    """mg train's own model keys: which family and preset, and the sample lengths."""

    type: str = "gpt"
    """Model family: gpt (causal LM), bert (masked LM + sentence order), t5 (encoder-decoder span corruption), or
    one another installed package adds (the ``mg_models.families`` entry points)."""
    preset: str | None = None
    """Named shape to start from, e.g. gpt2-small, tiny-llama, bert-base, tiny-bert, t5-small, tiny-t5 (of the
    model.type family); the keys below override it."""
    seq_length: int = 256
    """Tokens per training sample (t5: encoder input length); max_position_embeddings is raised to it."""
    decoder_seq_length: int | None = None
    """t5: decoder length (null: the span-corruption targets' length derived from seq_length as in the T5
    paper; larger pads)."""

    def __post_init__(self) -> None:
        known = [f.name for f in families().values()]
        if self.type not in known:
            raise ConfigError(f"model.type={self.type!r} is not an installed model family; choose one of {known}")
        if self.seq_length < 1:
            raise ConfigError(f"model.seq_length must be >= 1, got {self.seq_length}")
        if self.decoder_seq_length is not None and self.decoder_seq_length < 1:
            raise ConfigError(f"model.decoder_seq_length must be >= 1, got {self.decoder_seq_length}")


@dataclass(kw_only=True)
class TrainKeys:
    """Batch sizes and length of the run."""

    micro_batch_size: int = 4
    """Samples per micro-batch per data-parallel rank."""
    global_batch_size: int = 16
    """Samples per optimizer step over all ranks (= micro x dp x accumulation)."""
    iters: int = 100
    """Optimizer steps to train."""
    seed: int = 1234
    """Seed for initialisation, data order and dropout."""
    exit_after_minutes: float | None = None
    """Save (if configured) and stop after this many minutes."""
    threads: int | None = None
    """torch intra-op threads per process (null: cores / local processes)."""
    compile: bool = False
    """torch.compile each transformer layer (regional compilation: identical layers share one compiled graph;
    a mixture-of-experts layer compiles its attention, its experts stay eager). The time spent compiling is
    logged as compile_s and left out of tokens/s."""

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "global_batch_size", "iters"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"train.global_batch_size={self.global_batch_size} is not divisible by "
                f"train.micro_batch_size={self.micro_batch_size}"
            )


@dataclass(kw_only=True)
class ScheduleKeys:
    """The learning-rate schedule (``mg_cli.training.schedule.LRSchedule``) around optim.lr and optim.min_lr."""

    warmup_iters: int = 0
    """Linear warm-up steps from 0 to lr."""
    decay_iters: int | None = None
    """Step at which decay ends (null: train.iters, so a resumed run follows the same schedule)."""
    decay_style: Literal["constant", "linear", "cosine", "wsd"] = "cosine"
    """Decay shape after warm-up."""
    wsd_decay_fraction: float = 0.2
    """With decay_style=wsd: fraction of decay_iters spent decaying at the end."""

    def __post_init__(self) -> None:
        if self.warmup_iters < 0:
            raise ConfigError(f"optim.warmup_iters must be >= 0, got {self.warmup_iters}")


@dataclass(kw_only=True)
class DataKeys:
    """Where samples come from."""

    format: Literal["pretrain", "sft", "classification", "seq2seq"] = "pretrain"
    """What the samples are: pretrain (documents; per model.type: causal LM, masked LM, span corruption), sft (gpt:
    conversations, the loss on the assistant turns), classification (gpt, bert: {text, text_pair?, label}, a
    classification head), seq2seq (t5: {input, target}, the loss on the target). Fine-tuning formats read what
    `mg preprocess --format F` wrote; classification and seq2seq also read a .jsonl file directly."""
    path: str | list[Any] | None = None
    """Dataset prefix (PREFIX.bin/.idx; fine-tuning formats: the --output-prefix of `mg preprocess`, or a .jsonl
    file), or a [weight, prefix, weight, prefix, ...] blend."""
    valid_path: str | None = None
    """Validation data of the fine-tuning formats (sft: a preprocessed prefix; classification, seq2seq: a prefix or
    .jsonl file) used whole instead of a data.split share of data.path."""
    tokenizer_model: str | None = None
    """Tokenizer file (SentencePiece .model or tokenizer.json)."""
    num_workers: int = 1
    """Data-loading worker processes per rank (0: load in the training process)."""
    cache_dir: str | None = None
    """Where sample-index caches go (null: next to the data)."""

    def __post_init__(self) -> None:
        if self.num_workers < 0:
            raise ConfigError(f"data.num_workers must be >= 0, got {self.num_workers}")


@dataclass(kw_only=True)
class EvalKeys:
    """Periodic validation."""

    interval: int = 0
    """Evaluate every this many iterations (0: only at the end if iters > 0)."""
    iters: int = 10
    """Validation micro-batches per evaluation."""
    tasks: list[str] = field(default_factory=list)
    """`mg eval` tasks run at every evaluation on the model being trained, as KIND:PATH or NAME=KIND:PATH (mg eval
    --task); each metric is logged as eval/<task>/<metric>."""
    allow_code_execution: bool = False
    """Let eval.tasks run the programs the model writes (humaneval tasks; untrusted code, run in subprocesses with
    a time limit, as mg eval --allow-code-execution). A humaneval task without it is refused at start."""

    def __post_init__(self) -> None:
        if self.interval < 0 or self.iters < 0:
            raise ConfigError(f"eval.interval and eval.iters must be >= 0, got {self.interval}, {self.iters}")
        if not self.allow_code_execution:
            from mg_cli.task_specs import parse_task

            for text in self.tasks:
                try:
                    kind = parse_task(text).kind
                except (ValueError, TypeError, AttributeError):
                    continue  # a malformed entry is reported when the tasks are read
                if kind == "humaneval":
                    raise ConfigError(f"eval.tasks: {text} runs the programs the model writes, which are untrusted "
                                      f"code; set eval.allow_code_execution: true to run them, or remove the task")


@dataclass(kw_only=True)
class CheckpointKeys:
    """Saving and resuming."""

    save: str | None = None
    """Save directory (iter_NNNNNNN/ under it)."""
    load: str | None = None
    """Checkpoint directory or save directory to resume from."""
    init_from: str | None = None
    """Start from these weights only (fine-tuning): a Hugging Face model directory or an mg checkpoint of any
    layout. Iteration 1, a fresh optimizer, schedule and data stream; the architecture is the pretrained one
    (model.* keys given override it); a resumable checkpoint (checkpoint.load, or --resume) takes precedence."""
    interval: int = 0
    """Save every this many iterations (0: only at the end)."""
    async_: bool = field(default=False, metadata={"yaml_name": "async"})
    """Write checkpoints in the background."""
    keep_last: int | None = None
    """Keep only the newest k checkpoints (null: keep all)."""
    on_signal: Literal["save_and_stop", "save_and_continue"] = "save_and_stop"
    """On SIGUSR1 (e.g. Slurm's --signal=USR1@90): save, then stop or continue (SIGTERM/SIGINT always save
    and stop)."""

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ConfigError(f"checkpoint.interval must be >= 0, got {self.interval}")
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last must be >= 1 or null, got {self.keep_last}")


@dataclass(kw_only=True)
class LogKeys:
    """Where progress goes."""

    dir: str = "runs/mg"
    """Log directory: metrics.jsonl, config.yaml, TensorBoard events, offline W&B runs."""
    interval: int = 1
    """Log every this many iterations."""
    tensorboard: bool = False
    """Write TensorBoard scalars (needs the mg-cli[tensorboard] extra)."""
    wandb_project: str | None = None
    """Weights & Biases project to log the same scalars (step = iteration) and the run config to, from rank 0
    (null: no W&B; needs the mg-cli[wandb] extra)."""
    wandb_entity: str | None = None
    """W&B user or team owning log.wandb_project (null: the account's default)."""
    wandb_run_name: str | None = None
    """W&B run name (null: W&B picks one)."""
    wandb_mode: Literal["online", "offline"] | None = None
    """online: sync while training; offline: write the run under LOGDIR/wandb only (`wandb sync` uploads it);
    null: the WANDB_MODE environment variable, else online."""
    peak_tflops: float | None = None
    """Peak TFLOP/s of one device that mfu divides by (null: NVIDIA's published dense figure for a known GPU in
    bf16/fp16, else measured at start-up); set it for a GPU that mg's table lacks."""

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ConfigError(f"log.interval must be >= 1, got {self.interval}")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ConfigError(f"log.peak_tflops must be > 0 or null, got {self.peak_tflops}")
        for name in ("wandb_entity", "wandb_run_name", "wandb_mode"):
            if getattr(self, name) is not None and self.wandb_project is None:
                raise ConfigError(f"log.{name} is set but log.wandb_project is not; set the project to log to W&B")


_OPTIMIZER = "mg_parallel.optimizer.config:OptimizerConfig"
_ZERO = ("use_distributed_optimizer", "overlap_param_gather")
_LOSS_SCALING = ("precision", "loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")
_RUN_LENGTHS = ("seq_length", "max_seq_length", "encoder_seq_length", "decoder_seq_length")
_RUN_IDS = ("vocab_size", "eod_id", "cls_id", "sep_id", "mask_id", "pad_id", "sentinel_ids", "eos_id",
            "decoder_start_id", "separator_ids")
_DATA_RUN_FIELDS = {
    "mg_data.gpt_dataset:GPTDatasetConfig": ("reset_attention_mask", "create_attention_mask"),
    "mg_data.bert_dataset:BertDatasetConfig": ("is_word_start", "word_starts"),
    "mg_data.sft_dataset:SFTDatasetConfig": ("create_attention_mask",),
    "mg_data.classification:ClassificationDatasetConfig": ("end_ids",),
}
"""Fields of a sample-dataset config class that the run fills in besides lengths, special ids, seed and cache."""


def _model_sources() -> tuple[Source, ...]:
    """Each installed family's config class: its fields are the ``model.*`` keys."""
    return tuple(Source(f.config_class, family=f.name, exclude=f.run_filled_fields) for f in families().values())


def _data_sources() -> tuple[Source, ...]:
    """Each family's sample-dataset config class per ``data.format``: its fields are the ``data.*`` keys."""
    return tuple(Source(cls, family=f.name, format=fmt,
                        exclude=(*_RUN_LENGTHS, *_RUN_IDS, "seed", "cache_dir", *_DATA_RUN_FIELDS.get(cls, ())))
                 for f in families().values() for fmt, cls in f.dataset_classes.items())


RENAMED: dict[str, tuple[str, dict[Any, Any]]] = {
    "model.bias": ("model.add_bias_linear", {}),
    "model.init_std": ("model.init_method_std", {}),
    "model.tie_embeddings": ("model.tie_word_embeddings", {}),
    "parallel.distributed_optimizer": ("parallel.use_distributed_optimizer", {}),
    "parallel.recompute": ("parallel.recompute_granularity", {"none": None}),
}
"""Keys of earlier releases: old ``section.key`` -> (new key, old value -> new value where they differ)."""

SCHEMA = Schema(sections=(
    SectionSpec(
        name="model", doc="The network: the fields of the family's config class; unset (null) ones come from "
                          "model.preset, else the class's default.",
        cli=ModelKeys, unset_is_null=True,
        sources=_model_sources(),
    ),
    SectionSpec(
        name="parallel", doc="How the job is split over processes; dp is derived (world size / (tp * pp * cp)).",
        sources=(Source("mg_parallel.grid:ParallelDims", exclude=("world_size",)),
                 Source("mg_parallel.distributed.fsdp_mesh:FSDPConfig"),
                 Source("mg_parallel.recompute:RecomputeConfig", prefix="recompute_"),
                 Source(_OPTIMIZER, only=_ZERO)),
    ),
    SectionSpec(name="train", doc="Batch sizes, length and precision of the run.", cli=TrainKeys,
                sources=(Source(_OPTIMIZER, only=_LOSS_SCALING),)),
    SectionSpec(name="optim", doc="AdamW and the learning-rate schedule.", cli=ScheduleKeys,
                sources=(Source(_OPTIMIZER, exclude=_ZERO + _LOSS_SCALING),),
                defaults={"lr": 3e-4, "weight_decay": 0.1, "adam_beta2": 0.95}),
    SectionSpec(
        name="data", doc="Where samples come from and how the family's samples are made.", cli=DataKeys,
        sources=_data_sources(),
    ),
    SectionSpec(name="eval", doc="Periodic validation.", cli=EvalKeys),
    SectionSpec(name="checkpoint", doc="Saving and resuming.", cli=CheckpointKeys),
    SectionSpec(name="log", doc="Where progress goes.", cli=LogKeys),
), renamed=RENAMED)
"""The sections of ``mg train``'s configuration, in YAML order."""
