"""Build this rank's model chunks, their DDP wrappers and the optimizer from a run config."""

from __future__ import annotations

from typing import Any

import torch

from mg_cli.config import RunConfig
from mg_cli.training.families import bert_model_config, check_t5_layout, gpt_model_config, t5_model_config
from mg_cli.training.setup import TrainingError
from mg_models import GPTModel
from mg_parallel.distributed import DistributedDataParallel
from mg_parallel.grid import ProcessGrid
from mg_parallel.optimizer import OptimizerConfig, build_optimizer
from mg_parallel.pipeline import partition_layers
from mg_parallel.precision import Precision
from mg_parallel.recompute import RecomputeConfig
from mg_parallel.tensor_parallel import RNGTracker


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
    return gpt_model_config(config, vocab_size)


def check_model_layout(cfg: Any, config: RunConfig) -> None:
    """Divisibility of heads, groups, ffn and layers by the layout, and what a family cannot do (no collective)."""
    from mg_models.config import check_parallel

    p = config.parallel
    if config.model.type == "t5":
        check_t5_layout(config)  # what mg train does not do for T5 (pp, sp, recompute), naming the key
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
    dtype = Precision.from_name(config.train.precision).param_dtype
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
    precision = Precision.from_name(t.precision)
    wrapped = [
        DistributedDataParallel(chunk, grid, use_distributed_optimizer=p.distributed_optimizer, precision=precision)
        for chunk in chunks
    ]
    opt_config = OptimizerConfig(
        lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps, clip_grad=o.clip_grad, precision=t.precision,
        use_distributed_optimizer=p.distributed_optimizer, loss_scale=t.loss_scale,
        initial_loss_scale=t.initial_loss_scale,
    )
    return wrapped, build_optimizer(wrapped, grid, opt_config)
