"""AdamW over FSDP2's parameter shards, with the same step, clipping, loss scaling and state as the DDP optimizer.

Under :class:`~mg_parallel.distributed.fsdp.FullyShardedChunk` every parameter is an fp32 ``DTensor`` whose
local shard is a contiguous run ``[lo, hi)`` of the flattened (tensor-parallel local) parameter. Each
non-empty shard is one piece of :class:`~mg_parallel.optimizer.optimizer.MegatronStyleOptimizer`: the main
parameter is the shard itself (updated in place, nothing to copy back), the Adam moments are fp32 tensors
of the shard's size on the shard's device (the host under ``offload``), and the gradient is read from the
parameter's reduce-scattered gradient shard at every step. ``state_dict()`` is therefore the same
``mg-optimizer-v1`` format, one flat range per parameter, which checkpoints store as slices of the global
tensor.

Memory per parameter: (4 + 4 + 8) / shard_size bytes between steps (fp32 shard, gradient shard, moments),
plus the gathered layers of the prefetch window during a step.
"""

from __future__ import annotations

from typing import Any

import torch

from mg_parallel.grid import ProcessGrid
from mg_parallel.optimizer.clip import counts_in_norm
from mg_parallel.optimizer.config import OptimizerConfig
from mg_parallel.optimizer.optimizer import MegatronStyleOptimizer, _Piece
from mg_parallel.precision import Precision
from mg_parallel.tensor_parallel.utils import is_tensor_parallel

__all__ = ["FSDPOptimizer"]


class FSDPOptimizer(MegatronStyleOptimizer):
    """:class:`MegatronStyleOptimizer` over the local shards of FSDP-sharded chunks (build it with
    :func:`~mg_parallel.optimizer.build_optimizer` on ``FullyShardedChunk`` s)."""

    def __init__(self, model_chunks: list[Any], grid: ProcessGrid, config: OptimizerConfig,
                 precision: Precision | None = None) -> None:
        from mg_parallel.distributed.fsdp import local_flat_range, replicas

        if config.use_distributed_optimizer:
            raise ValueError("FSDP-sharded chunks already shard the optimizer state; set "
                             "use_distributed_optimizer: false")
        self._setup(model_chunks, grid, config, precision)
        self.sharded = True
        main_dtype = self.precision.main_param_dtype
        for ci, chunk in enumerate(model_chunks):
            for name, p in chunk.module.named_parameters():
                if not p.requires_grad:
                    continue
                if grid.tp_size > 1:
                    is_tensor_parallel(p, name)  # every rank checks every parameter, so all fail together
                if p.dtype != main_dtype:
                    raise ValueError(f"parameter {name!r} of chunk {ci} is {p.dtype}; FSDP keeps {main_dtype} main "
                                     f"parameters (apply_fsdp casts only for compute)")
                lo, hi = local_flat_range(p)
                if hi == lo:
                    continue  # this rank holds no rows of a parameter smaller than the shard group
                with torch.no_grad():
                    main = p.to_local().view(-1)
                exp_avg = torch.zeros_like(main)
                exp_avg_sq = torch.zeros_like(main)
                self._moments += [exp_avg, exp_avg_sq]
                group = 0 if p.ndim >= 2 or config.decay_1d_params else 1
                self.param_groups[group]["params"].append(p)
                self.pieces.append(_Piece(
                    chunk=ci, name=name, param=p, flat_offset=lo, numel=hi - lo, grad=None, main=main,
                    exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, group=group, aliased=True,
                    counted=replicas(p)[0] == 0 and counts_in_norm(p, grid, sharded_over_dp=True, name=name),
                ))
        self._dedupe_groups()

    def _grads(self) -> list[torch.Tensor]:
        out = []
        for piece in self.pieces:
            g = piece.param.grad
            # A parameter that took no part in this step's loss has no gradient: it contributes zero.
            out.append(torch.zeros_like(piece.main) if g is None else g.to_local().view(-1))
        return out
