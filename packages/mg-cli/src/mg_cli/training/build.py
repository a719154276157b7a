"""Build this rank's model chunks, their DDP wrappers and the optimizer from a run config."""

from __future__ import annotations

from typing import Any

import torch

from mg_cli.config import RunConfig
from mg_cli.training.families import check_layout, family, model_config
from mg_cli.training.setup import TrainingError
from mg_parallel.distributed import DistributedDataParallel
from mg_parallel.grid import ProcessGrid
from mg_parallel.optimizer import OptimizerConfig, build_optimizer
from mg_parallel.precision import Precision
from mg_parallel.recompute import RecomputeConfig
from mg_parallel.tensor_parallel import RNGTracker

__all__ = ["build_model_chunks", "check_model_layout", "model_config", "wrap_and_build_optimizer"]


def check_model_layout(cfg: Any, config: RunConfig) -> None:
    """Divisibility of heads, groups, ffn and layers by the layout, and what the family cannot do (no collective)."""
    p = config.parallel
    check_layout(cfg, config)  # the family's own refusals (naming the key), then tp/pp divisibility
    check_expert_layout(cfg, config)
    layers, what = family(config).pipeline_layers(cfg)
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


def build_model_chunks(cfg: Any, config: RunConfig, grid: ProcessGrid, rng: RNGTracker, precision: Precision
                       ) -> list[torch.nn.Module]:
    """This pipeline rank's model chunks (one per virtual stage), with recomputation as configured, built the way
    every command gets a model (:func:`mg_models.loading.build_model`; the family says which layers each holds), in
    ``precision`` (the run's policy: its parameter dtype and GEMM recipe)."""
    from mg_models.loading import build_model

    # FSDP keeps fp32 main parameters as its shards and casts to the compute dtype when it gathers them.
    dtype = precision.main_param_dtype if config.parallel.fsdp else None
    recompute = config.make(RecomputeConfig)
    chunks = build_model(cfg, grid, precision=precision, dtype=dtype, vpp=grid.dims.vpp, seed=config.train.seed,
                         rng_tracker=rng, recompute=recompute if recompute.granularity else None,
                         family=family(config))
    return _compiled(chunks, config)


def _compiled(chunks: list[torch.nn.Module], config: RunConfig) -> list[torch.nn.Module]:
    """``train.compile``: each transformer layer of each chunk compiled in place (regional compilation)."""
    if config.train.compile:
        from mg_models.compilation import compile_layers

        for chunk in chunks:
            compile_layers(chunk)
    return chunks


def wrap_and_build_optimizer(chunks: list[torch.nn.Module], config: RunConfig, grid: ProcessGrid,
                             precision: Precision) -> tuple[list[Any], Any]:
    """DDP-wrap (or, with ``parallel.fsdp``, FSDP-shard) every chunk and build the optimizer over them, from
    ``OptimizerConfig`` and ``FSDPConfig``, all in ``precision`` (the run's policy)."""
    from mg_parallel.distributed.fsdp_mesh import FSDPConfig

    opt_config = config.make(OptimizerConfig)
    fsdp = config.make(FSDPConfig)
    if fsdp.fsdp:
        from mg_parallel.distributed.fsdp import FullyShardedChunk

        wrapped: list[Any] = [FullyShardedChunk(chunk, grid, precision, shard_size=fsdp.fsdp_shard_size,
                                                offload=fsdp.offload_optimizer) for chunk in chunks]
    else:
        wrapped = [DistributedDataParallel(chunk, grid, use_distributed_optimizer=opt_config.use_distributed_optimizer,
                                           precision=precision) for chunk in chunks]
    return wrapped, build_optimizer(wrapped, grid, opt_config, precision=precision)
