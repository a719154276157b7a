"""Build this rank's model chunks, their DDP wrappers and the optimizer from a run config."""

from __future__ import annotations

from typing import Any

import torch

from mg_cli.config import RunConfig
from mg_cli.training.families import check_t5_layout, model_config
from mg_cli.training.setup import TrainingError
from mg_models import GPTModel
from mg_parallel.distributed import DistributedDataParallel
from mg_parallel.grid import ProcessGrid
from mg_parallel.optimizer import OptimizerConfig, build_optimizer
from mg_parallel.pipeline import partition_layers
from mg_parallel.precision import Precision
from mg_parallel.recompute import RecomputeConfig
from mg_parallel.tensor_parallel import RNGTracker

__all__ = ["build_model_chunks", "check_model_layout", "model_config", "wrap_and_build_optimizer"]


def check_model_layout(cfg: Any, config: RunConfig) -> None:
    """Divisibility of heads, groups, ffn and layers by the layout, and what a family cannot do (no collective)."""
    from mg_models.config import check_parallel, pipeline_layers
    from mg_models.layers import check_context_parallel

    p = config.parallel
    if config.model.type == "t5":
        check_t5_layout(config)  # what mg train does not do for T5 (pp, sp, recompute), naming the key
    elif (cfg.head == "lm") != (config.data.format != "classification"):
        raise TrainingError(f"model.head={cfg.head} does not fit data.format={config.data.format}: a classification "
                            f"head trains on data.format=classification, every other format on model.head=lm")
    check_expert_layout(cfg, config)
    try:
        check_parallel(cfg, p.tp, p.pp)
        if config.model.type == "gpt":
            check_context_parallel(cfg, p.tp, p.cp, p.cp_comm)
    except ValueError as e:
        raise TrainingError(str(e)) from None
    layers, what = pipeline_layers(cfg)
    if layers % (p.pp * p.vpp):
        raise TrainingError(
            f"{what} cannot be split evenly over parallel.pp*parallel.vpp = "
            f"{p.pp}*{p.vpp} = {p.pp * p.vpp} pipeline stages; choose a layer count divisible by it"
        )


def check_expert_layout(cfg: Any, config: RunConfig) -> None:
    """``parallel.ep`` / ``parallel.etp`` need an MoE model whose experts (and expert FFN) they divide."""
    p = config.parallel
    if p.ep == 1 and p.etp == 1:
        return
    key = "parallel.ep" if p.ep > 1 else "parallel.etp"
    if not getattr(cfg, "is_moe", False):
        raise TrainingError(f"{key}={getattr(p, key.split('.')[1])} needs a mixture-of-experts model "
                            f"(model.num_experts, e.g. model.preset=tiny-moe); set it to 1 for a dense model")
    if cfg.num_experts % p.ep:
        raise TrainingError(f"parallel.ep={p.ep} does not divide model.num_experts={cfg.num_experts}; choose an ep "
                            f"that divides it")
    if cfg.moe_ffn_size % p.etp:
        raise TrainingError(f"parallel.etp={p.etp} does not divide the expert FFN size {cfg.moe_ffn_size} "
                            f"(model.moe_ffn_hidden_size)")
    if p.fsdp:
        raise TrainingError(f"parallel.fsdp with {key} > 1 is not supported yet (FSDP would shard the experts over "
                            f"ranks that hold different ones); use the distributed optimizer instead")


def build_model_chunks(cfg: Any, config: RunConfig, grid: ProcessGrid, rng: RNGTracker) -> list[torch.nn.Module]:
    """This pipeline rank's model chunks (one per virtual stage), with recomputation as configured.

    GPT and BERT are cut into pipeline stages by layer; T5 by its encoder layers followed by its decoder layers
    (one chunk per rank).
    """
    dims = grid.dims
    policy = Precision.from_name(config.train.precision)
    # FSDP keeps fp32 main parameters as its shards and casts to the compute dtype when it gathers them.
    dtype = policy.main_param_dtype if config.parallel.fsdp else policy.param_dtype
    if config.model.type == "t5":
        from mg_models.config import pipeline_layers
        from mg_models.t5 import T5Model

        (layers,) = partition_layers(pipeline_layers(cfg)[0], dims.pp)[grid.pp_rank]
        return _compiled([T5Model(cfg, grid, pre_process=grid.is_first_stage, post_process=grid.is_last_stage,
                                  layer_range=(layers.start, layers.stop), seed=config.train.seed, rng_tracker=rng,
                                  dtype=dtype)], config)
    model_cls = GPTModel
    if config.model.type == "bert":
        from mg_models.bert import BertModel

        model_cls = BertModel
    ranges = partition_layers(cfg.num_layers, dims.pp, dims.vpp)[grid.pp_rank]
    recompute = config.make(RecomputeConfig)
    chunks = []
    for c, layers in enumerate(ranges):
        first = grid.is_first_stage and c == 0
        last = grid.is_last_stage and c == len(ranges) - 1
        chunks.append(model_cls(cfg, grid, pre_process=first, post_process=last,
                                layer_range=(layers.start, layers.stop), sequence_parallel=dims.sequence_parallel,
                                seed=config.train.seed, rng_tracker=rng,
                                recompute=recompute if recompute.granularity else None, dtype=dtype))
    return _compiled(chunks, config)


def _compiled(chunks: list[torch.nn.Module], config: RunConfig) -> list[torch.nn.Module]:
    """``train.compile``: each transformer layer of each chunk compiled in place (regional compilation)."""
    if config.train.compile:
        from mg_models.compilation import compile_layers

        for chunk in chunks:
            compile_layers(chunk)
    return chunks


def wrap_and_build_optimizer(chunks: list[torch.nn.Module], config: RunConfig, grid: ProcessGrid) -> tuple[list[Any], Any]:
    """DDP-wrap (or, with ``parallel.fsdp``, FSDP-shard) every chunk and build the optimizer over them, from
    ``OptimizerConfig`` and ``FSDPConfig``."""
    from mg_parallel.distributed.fsdp_mesh import FSDPConfig

    opt_config = config.make(OptimizerConfig)
    precision = Precision.from_name(opt_config.precision)
    fsdp = config.make(FSDPConfig)
    if fsdp.fsdp:
        from mg_parallel.distributed.fsdp import FullyShardedChunk

        wrapped: list[Any] = [FullyShardedChunk(chunk, grid, precision, shard_size=fsdp.fsdp_shard_size,
                                                offload=fsdp.offload_optimizer) for chunk in chunks]
    else:
        wrapped = [DistributedDataParallel(chunk, grid, use_distributed_optimizer=opt_config.use_distributed_optimizer,
                                           precision=precision) for chunk in chunks]
    return wrapped, build_optimizer(wrapped, grid, opt_config)
