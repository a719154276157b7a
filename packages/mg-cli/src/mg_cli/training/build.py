"""Build this rank's model chunks, their DDP wrappers and the optimizer from a run config."""

from __future__ import annotations

from typing import Any

import torch

from mg_cli.config import RunConfig
from mg_cli.training.setup import TrainingError
from mg_models import GPTConfig, GPTModel
from mg_models.presets import PRESETS
from mg_parallel.distributed import DistributedDataParallel
from mg_parallel.grid import ProcessGrid
from mg_parallel.optimizer import OptimizerConfig, build_optimizer
from mg_parallel.pipeline import partition_layers
from mg_parallel.recompute import recompute
from mg_parallel.tensor_parallel import RNGTracker

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# RunConfig.model key -> GPTConfig field
_MODEL_KEYS = {
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_query_groups",
    "ffn_hidden_size": "ffn_hidden_size",
    "position_embedding": "position_embedding",
    "normalization": "normalization",
    "activation": "activation",
    "tie_embeddings": "tie_word_embeddings",
    "bias": "add_bias_linear",
    "rotary_base": "rotary_base",
    "init_std": "init_method_std",
}


def model_config(config: RunConfig, vocab_size: int) -> GPTConfig:
    """The GPT architecture: the preset (if any), the config's explicit fields, the tokenizer's vocabulary.

    Raises:
        TrainingError: unknown preset, missing shape fields without a preset, or an invalid combination.
    """
    m = config.model
    if m.type != "gpt":
        raise TrainingError(f"model.type={m.type!r} is not supported by this version of mg train; use gpt")
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


def check_model_layout(cfg: GPTConfig, config: RunConfig) -> None:
    """Divisibility of heads, groups, ffn and layers by the layout (no collective)."""
    from mg_models.config import check_parallel

    p = config.parallel
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


def build_model_chunks(cfg: GPTConfig, config: RunConfig, grid: ProcessGrid, rng: RNGTracker) -> list[GPTModel]:
    """This pipeline rank's model chunks (one per virtual stage), with recomputation as configured."""
    p = config.parallel
    ranges = partition_layers(cfg.num_layers, p.pp, p.vpp)[grid.pp_rank]
    dtype = PRECISION_DTYPES[config.train.precision]
    chunks = []
    for c, layers in enumerate(ranges):
        first = grid.is_first_stage and c == 0
        last = grid.is_last_stage and c == len(ranges) - 1
        recompute_fn = None
        if p.recompute == "full":
            budget = p.recompute_num_layers

            def recompute_fn(layer, *args, _budget=budget, _start=layers.start, **kw):  # noqa: ANN001
                index = int(getattr(layer, "layer_number", _start))
                if _budget is None or index - _start < _budget:
                    return recompute(layer, *args, rng_tracker=rng, **kw)
                return layer(*args, **kw)
        chunks.append(GPTModel(cfg, grid, pre_process=first, post_process=last,
                               layer_range=(layers.start, layers.stop), sequence_parallel=p.sequence_parallel,
                               seed=config.train.seed, rng_tracker=rng, recompute=recompute_fn, dtype=dtype))
    return chunks


def wrap_and_build_optimizer(chunks: list[GPTModel], config: RunConfig, grid: ProcessGrid) -> tuple[list[Any], Any]:
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
