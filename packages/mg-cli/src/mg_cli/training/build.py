"""Build this rank's model chunks, their DDP wrappers and the optimizer from a run config."""

from __future__ import annotations

from typing import Any

import torch

from mg_cli.config import RunConfig
from mg_cli.training.families import bert_model_config, check_t5_layout, t5_model_config
from mg_cli.training.setup import TrainingError
from mg_models import GPTConfig, GPTModel
from mg_models.presets import PRESETS
from mg_parallel.distributed import DistributedDataParallel
from mg_parallel.grid import ProcessGrid
from mg_parallel.optimizer import OptimizerConfig, build_optimizer
from mg_parallel.pipeline import partition_layers
from mg_parallel.recompute import RecomputeConfig
from mg_parallel.tensor_parallel import RNGTracker

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# RunConfig.model key -> GPTConfig field
_MODEL_KEYS = {
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_query_groups",
    "ffn_hidden_size": "ffn_hidden_size",
    "kv_channels": "kv_channels",
    "position_embedding": "position_embedding",
    "normalization": "normalization",
    "activation": "activation",
    "tie_embeddings": "tie_word_embeddings",
    "bias": "add_bias_linear",
    "rotary_base": "rotary_base",
    "init_std": "init_method_std",
}


def model_config(config: RunConfig, vocab_size: int) -> Any:
    """The architecture of ``model.type``: the preset (if any), the config's explicit fields, the tokenizer's
    vocabulary. A ``GPTConfig``, ``BertConfig`` or ``T5Config``.

    Raises:
        TrainingError: unknown preset, missing shape fields without a preset, or an invalid combination.
    """
    m = config.model
    if m.type == "bert":
        return bert_model_config(config, vocab_size)
    if m.type == "t5":
        return t5_model_config(config, vocab_size)
    for key in ("num_decoder_layers", "decoder_seq_length"):
        if getattr(m, key) is not None:
            raise TrainingError(f"model.{key} is only used by model.type=t5; leave it unset for gpt")
    if m.activation in ("relu", "gated-gelu"):
        raise TrainingError(f"model.activation={m.activation} is a T5 activation; use gelu, gelu_tanh or swiglu for gpt")
    fields: dict[str, Any] = {}
    if m.preset is not None:
        if m.preset not in PRESETS:
            raise TrainingError(f"model.preset={m.preset!r} is unknown; choose one of {sorted(PRESETS)}")
        fields.update(PRESETS[m.preset]())
    for key, target in _MODEL_KEYS.items():
        value = getattr(m, key)
        if value is not None:
            fields[target] = value
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if k not in fields]
    if missing:
        raise TrainingError(f"model.{missing[0]} is not set and model.preset is not given; set a preset or the shape")
    fields["vocab_size"] = vocab_size
    fields["attention_dropout"] = m.dropout
    fields["hidden_dropout"] = m.dropout
    fields["max_position_embeddings"] = max(int(fields.get("max_position_embeddings", 0)), m.seq_length)
    try:
        return GPTConfig(**fields)
    except (TypeError, ValueError) as e:
        raise TrainingError(str(e)) from None


def check_model_layout(cfg: Any, config: RunConfig) -> None:
    """Divisibility of heads, groups, ffn and layers by the layout, and what a family cannot do (no collective)."""
    from mg_models.config import check_parallel

    p = config.parallel
    if config.model.type == "t5":
        check_t5_layout(config)
        for what, value in (("model.num_attention_heads", cfg.num_attention_heads),
                            ("model.ffn_hidden_size", cfg.ffn_hidden_size),
                            ("padded vocabulary (model.make_vocab_size_divisible_by)", cfg.padded_vocab_size)):
            if value % p.tp:
                raise TrainingError(f"{what}={value} is not divisible by parallel.tp={p.tp}; choose a tp that divides it")
        return
    if p.recompute == "selective":
        raise TrainingError("parallel.recompute=selective is not supported by mg train yet; use full (optionally "
                            "with parallel.recompute_num_layers) or none")
    try:
        check_parallel(cfg, p.tp, p.pp)
    except ValueError as e:
        raise TrainingError(str(e)) from None
    if cfg.num_layers % (p.pp * p.vpp):
        raise TrainingError(
            f"model.num_layers={cfg.num_layers} cannot be split evenly over parallel.pp*parallel.vpp = "
            f"{p.pp}*{p.vpp} = {p.pp * p.vpp} pipeline stages; choose a layer count divisible by it"
        )


def build_model_chunks(cfg: Any, config: RunConfig, grid: ProcessGrid, rng: RNGTracker) -> list[torch.nn.Module]:
    """This pipeline rank's model chunks (one per virtual stage), with recomputation as configured.

    GPT and BERT are cut into pipeline stages by layer; T5 is one chunk (pp must be 1).
    """
    p = config.parallel
    dtype = PRECISION_DTYPES[config.train.precision]
    if config.model.type == "t5":
        from mg_models.t5 import T5Model

        return [T5Model(cfg, grid, seed=config.train.seed, rng_tracker=rng, dtype=dtype)]
    model_cls = GPTModel
    if config.model.type == "bert":
        from mg_models.bert import BertModel

        model_cls = BertModel
    ranges = partition_layers(cfg.num_layers, p.pp, p.vpp)[grid.pp_rank]
    # Full recompute of the first recompute_num_layers layers of every chunk (all when null).
    recompute = RecomputeConfig(granularity="full", num_layers=p.recompute_num_layers) if p.recompute == "full" else None
    chunks = []
    for c, layers in enumerate(ranges):
        first = grid.is_first_stage and c == 0
        last = grid.is_last_stage and c == len(ranges) - 1
        chunks.append(model_cls(cfg, grid, pre_process=first, post_process=last,
                                layer_range=(layers.start, layers.stop), sequence_parallel=p.sequence_parallel,
                                seed=config.train.seed, rng_tracker=rng, recompute=recompute, dtype=dtype))
    return chunks


def wrap_and_build_optimizer(chunks: list[torch.nn.Module], config: RunConfig, grid: ProcessGrid) -> tuple[list[Any], Any]:
    """DDP-wrap every chunk and build the (distributed) optimizer."""
    p, o, t = config.parallel, config.optim, config.train
    wrapped = [
        DistributedDataParallel(
            chunk, grid, use_distributed_optimizer=p.distributed_optimizer,
            grad_reduce_in_fp32=t.precision != "fp32",
        )
        for chunk in chunks
    ]
    opt_config = OptimizerConfig(
        lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps, clip_grad=o.clip_grad, precision=t.precision,
        use_distributed_optimizer=p.distributed_optimizer, loss_scale=t.loss_scale,
        initial_loss_scale=t.initial_loss_scale,
    )
    return wrapped, build_optimizer(wrapped, grid, opt_config)
