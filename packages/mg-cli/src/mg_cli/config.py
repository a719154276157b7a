"""The run configuration: a YAML file with one section per concern, plus ``--set`` overrides.

Each section is a small dataclass whose fields carry their own help text. Unknown keys are
errors that suggest the nearest valid key; ``--set section.key=value`` values are parsed as YAML
and type-checked against the field. This module imports no torch, so ``mg --help`` stays instant.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A configuration problem, with a message naming the key and the fix."""


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


@dataclass(kw_only=True)
class ModelSection:
    """The network. Unset fields (null) come from ``preset``."""

    type: Literal["gpt", "bert", "t5"] = _f("gpt", "model family: gpt (causal LM), bert (masked LM + sentence order), "
                                                  "t5 (encoder-decoder span corruption)")
    preset: str | None = _f(None, "named shape to start from, e.g. gpt2-small, tiny-llama, bert-base, tiny-bert, "
                                  "t5-small, tiny-t5 (of the model.type family); fields below override it")
    num_layers: int | None = _f(None, "transformer layers")
    hidden_size: int | None = _f(None, "model width")
    num_attention_heads: int | None = _f(None, "attention heads")
    num_query_groups: int | None = _f(None, "key/value heads for grouped-query attention (null: = heads)")
    ffn_hidden_size: int | None = _f(None, "MLP inner width (null: 4 x hidden, or the preset's)")
    kv_channels: int | None = _f(None, "per-head dimension (null: hidden / heads, or the preset's)")
    num_decoder_layers: int | None = _f(None, "t5: decoder layers (null: = num_layers, or the preset's)")
    seq_length: int = _f(256, "tokens per training sample (t5: encoder input length)")
    decoder_seq_length: int | None = _f(None, "t5: decoder length (null: the span-corruption targets' length "
                                              "derived from seq_length as in the T5 paper; larger pads)")
    position_embedding: Literal["learned", "rope", "none"] | None = _f(None, "position embedding kind")
    normalization: Literal["layernorm", "rmsnorm"] | None = _f(None, "normalisation layer")
    activation: Literal["gelu", "gelu_tanh", "swiglu", "relu", "gated-gelu"] | None = _f(
        None, "MLP activation (gpt: gelu/gelu_tanh/swiglu; bert: gelu/gelu_tanh; t5: relu/gated-gelu)")
    tie_embeddings: bool | None = _f(None, "share input embedding and output head weights")
    bias: bool | None = _f(None, "biases in linear layers")
    dropout: float = _f(0.0, "attention and hidden dropout probability")
    rotary_base: float | None = _f(None, "RoPE base (theta)")
    init_std: float | None = _f(None, "std of the normal weight initialisation")

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                     "kv_channels", "num_decoder_layers", "decoder_seq_length"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"model.{name} must be >= 1, got {v}")
        if self.seq_length < 1:
            raise ConfigError(f"model.seq_length must be >= 1, got {self.seq_length}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")


@dataclass(kw_only=True)
class ParallelSection:
    """How the job is split over processes. dp is derived: world size / (tp * pp)."""

    tp: int = _f(1, "tensor-parallel size")
    pp: int = _f(1, "pipeline-parallel size")
    vpp: int = _f(1, "virtual pipeline stages (model chunks) per pipeline rank; > 1 selects the interleaved schedule")
    sequence_parallel: bool = _f(False, "shard activations along the sequence between tensor-parallel regions (needs tp > 1)")
    distributed_optimizer: bool = _f(False, "shard optimizer state and fp32 main weights over data-parallel ranks (ZeRO-1)")
    recompute: Literal["none", "full", "selective"] = _f("none", "activation recomputation")
    recompute_num_layers: int | None = _f(None, "with recompute=full: how many layers per stage to recompute (null: all)")

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "vpp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.vpp > 1 and self.pp == 1:
            raise ConfigError("parallel.vpp > 1 needs parallel.pp > 1; set vpp: 1 or raise pp")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("parallel.sequence_parallel needs parallel.tp > 1; set it to false or raise tp")


@dataclass(kw_only=True)
class TrainSection:
    """Batch sizes, length and precision of the run."""

    micro_batch_size: int = _f(4, "samples per micro-batch per data-parallel rank")
    global_batch_size: int = _f(16, "samples per optimizer step over all ranks (= micro x dp x accumulation)")
    iters: int = _f(100, "optimizer steps to train")
    seed: int = _f(1234, "seed for initialisation, data order and dropout")
    precision: Literal["fp32", "bf16", "fp16"] = _f("fp32", "compute precision (bf16/fp16 keep fp32 main weights)")
    exit_after_minutes: float | None = _f(None, "save (if configured) and stop after this many minutes")
    threads: int | None = _f(None, "torch intra-op threads per process (null: cores / local processes)")
    loss_scale: float | None = _f(None, "fp16: constant loss scale (null: dynamic scaling)")
    initial_loss_scale: float = _f(65536.0, "fp16 dynamic scaling: starting scale")

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
class OptimSection:
    """AdamW and the learning-rate schedule."""

    lr: float = _f(3e-4, "peak learning rate")
    min_lr: float = _f(0.0, "learning rate at the end of decay")
    warmup_iters: int = _f(0, "linear warm-up steps from 0 to lr")
    decay_iters: int | None = _f(None, "step at which decay ends (null: train.iters, so a resumed run follows the same schedule)")
    decay_style: Literal["constant", "linear", "cosine", "wsd"] = _f("cosine", "decay shape after warm-up")
    wsd_decay_fraction: float = _f(0.2, "with decay_style=wsd: fraction of decay_iters spent decaying at the end")
    weight_decay: float = _f(0.1, "decoupled weight decay (not applied to biases and norms)")
    clip_grad: float = _f(1.0, "clip the global gradient norm to this (0: off)")
    adam_beta1: float = _f(0.9, "Adam beta1")
    adam_beta2: float = _f(0.95, "Adam beta2")
    adam_eps: float = _f(1e-8, "Adam epsilon")

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"optim.lr must be > 0 and 0 <= optim.min_lr <= lr (got lr={self.lr}, min_lr={self.min_lr})")
        if self.warmup_iters < 0:
            raise ConfigError(f"optim.warmup_iters must be >= 0, got {self.warmup_iters}")
        if self.clip_grad < 0:
            raise ConfigError(f"optim.clip_grad must be >= 0, got {self.clip_grad}")


@dataclass(kw_only=True)
class DataSection:
    """Where samples come from."""

    path: str | list[Any] | None = _f(None, "dataset prefix (PREFIX.bin/.idx), or a [weight, prefix, weight, prefix, ...] blend")
    split: str = _f("969,30,1", "train,valid,test weights over documents")
    tokenizer_model: str | None = _f(None, "tokenizer file (SentencePiece .model or tokenizer.json)")
    num_workers: int = _f(1, "data-loading worker processes per rank (0: load in the training process)")
    cache_dir: str | None = _f(None, "where sample-index caches go (null: next to the data)")
    eod_mask_loss: bool = _f(False, "exclude end-of-document tokens from the loss")
    sentence_task: Literal["sop", "nsp", "none"] = _f(
        "sop", "bert: binary target of the sentence pair (sop: sentence order, nsp: next sentence, "
               "none: no binary head)")


@dataclass(kw_only=True)
class EvalSection:
    """Periodic validation."""

    interval: int = _f(0, "evaluate every this many iterations (0: only at the end if iters > 0)")
    iters: int = _f(10, "validation micro-batches per evaluation")


@dataclass(kw_only=True)
class CheckpointSection:
    """Saving and resuming."""

    save: str | None = _f(None, "save directory (iter_NNNNNNN/ under it)")
    load: str | None = _f(None, "checkpoint directory or save directory to resume from")
    interval: int = _f(0, "save every this many iterations (0: only at the end)")
    async_: bool = field(default=False, metadata={"help": "write checkpoints in the background", "yaml_name": "async"})
    keep_last: int | None = _f(None, "keep only the newest k checkpoints (null: keep all)")
    on_signal: Literal["save_and_stop", "save_and_continue"] = _f(
        "save_and_stop", "on SIGUSR1 (e.g. Slurm's --signal=USR1@90): save, then stop or continue "
        "(SIGTERM/SIGINT always save and stop)")


@dataclass(kw_only=True)
class LogSection:
    """Where progress goes."""

    dir: str = _f("runs/mg", "log directory: metrics.jsonl, config.yaml, TensorBoard events")
    interval: int = _f(1, "log every this many iterations")
    tensorboard: bool = _f(False, "write TensorBoard scalars (needs the mg-cli[tensorboard] extra)")


@dataclass(kw_only=True)
class RunConfig:
    """A whole run: one field per YAML section."""

    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    train: TrainSection = field(default_factory=TrainSection)
    optim: OptimSection = field(default_factory=OptimSection)
    data: DataSection = field(default_factory=DataSection)
    eval: EvalSection = field(default_factory=EvalSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    log: LogSection = field(default_factory=LogSection)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict with YAML key names (round-trips through :func:`from_dict`)."""
        out = {}
        for sec in dataclasses.fields(self):
            obj = getattr(self, sec.name)
            out[sec.name] = {_yaml_name(f): getattr(obj, f.name) for f in dataclasses.fields(obj)}
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _yaml_name(f: dataclasses.Field) -> str:
    return f.metadata.get("yaml_name", f.name)


def _section_fields(cls: type) -> dict[str, dataclasses.Field]:
    return {_yaml_name(f): f for f in dataclasses.fields(cls)}


_SECTIONS: dict[str, type] = {
    f.name: typing.get_type_hints(RunConfig)[f.name] for f in dataclasses.fields(RunConfig)
}


def all_keys() -> list[str]:
    """Every valid ``section.key``."""
    return [f"{s}.{k}" for s, cls in _SECTIONS.items() for k in _section_fields(cls)]


def _suggest(key: str) -> str:
    close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.5)
    if not close and "." in key:
        leaf = key.rsplit(".", 1)[1]
        close = [k for k in all_keys() if k.endswith("." + leaf)][:1]
    return f"; did you mean '{close[0]}'?" if close else f"; valid sections: {', '.join(_SECTIONS)}"


def _check_type(value: Any, tp: Any, key: str) -> Any:
    """Return ``value`` converted to ``tp`` where lossless (int -> float), else raise ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arg in typing.get_args(tp):
            try:
                return _check_type(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}={value!r} has the wrong type; expected {_type_name(tp)}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{key} expected null")
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        choices = ", ".join(repr(a) for a in typing.get_args(tp))
        raise ConfigError(f"{key}={value!r} is not one of {choices}")
    if origin is list:
        if isinstance(value, list):
            return value
        raise ConfigError(f"{key}={value!r} should be a list")
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"{key}={value!r} has the wrong type; expected {_type_name(tp)}")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def from_dict(raw: dict[str, Any], source: str = "config") -> RunConfig:
    """Build a validated :class:`RunConfig` from nested dicts.

    Raises:
        ConfigError: unknown section/key (with a suggestion), wrong type, or invalid value.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections ({', '.join(_SECTIONS)})")
    sections = {}
    for name, values in raw.items():
        if name not in _SECTIONS:
            close = difflib.get_close_matches(str(name), list(_SECTIONS), n=1, cutoff=0.5)
            hint = f"did you mean '{close[0]}'?" if close else f"valid sections: {', '.join(_SECTIONS)}"
            raise ConfigError(f"{source}: unknown section '{name}'; {hint}")
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: section '{name}' must be a mapping of keys to values")
        cls = _SECTIONS[name]
        fields = _section_fields(cls)
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for key, value in values.items():
            full = f"{name}.{key}"
            if key not in fields:
                raise ConfigError(f"{source}: unknown key '{full}'{_suggest(full)}")
            f = fields[key]
            try:
                kwargs[f.name] = _check_type(value, hints[f.name], full)
            except ConfigError as e:
                raise ConfigError(f"{source}: {e}") from None
        try:
            sections[name] = cls(**kwargs)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
    return RunConfig(**sections)


def parse_override(text: str) -> tuple[str, str, Any]:
    """Parse ``section.key=value`` (value as YAML) into ``(section, key, value)``."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. --set train.iters=100")
    key, _, raw_value = text.partition("=")
    key = key.strip()
    if key.count(".") != 1:
        raise ConfigError(f"--set {text!r}: the key must be section.key{_suggest(key)}")
    section, leaf = key.split(".")
    try:
        value = yaml.safe_load(raw_value) if raw_value.strip() else None
    except yaml.YAMLError:
        value = raw_value
    return section, leaf, value


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read the YAML file at ``path`` (or start from defaults), apply ``--set`` overrides, validate.

    Raises:
        ConfigError: missing/unreadable/invalid YAML, unknown keys, wrong types or invalid values.
    """
    raw: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {path} does not exist; pass --config FILE.yaml with a valid path")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"{path}{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections ({', '.join(_SECTIONS)})")
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for text in overrides:
        section, leaf, value = parse_override(text)
        if raw.get(section) is None:  # absent, or an empty `section:` line
            raw[section] = {}
        if not isinstance(raw[section], dict):
            raise ConfigError(f"{source}: section '{section}' must be a mapping of keys to values, not "
                              f"{raw[section]!r}; fix it before --set {text!r} can apply")
        raw[section][leaf] = value
    return from_dict(raw, source)


def describe() -> str:
    """Every key with its type, default and help, for ``mg train --list-keys``."""
    lines = []
    for sname, cls in _SECTIONS.items():
        lines.append(f"{sname}:")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            lines.append(f"  {_yaml_name(f)}: {default!r}  # {_type_name(hints[f.name])}; {f.metadata.get('help', '')}")
    return "\n".join(lines)
