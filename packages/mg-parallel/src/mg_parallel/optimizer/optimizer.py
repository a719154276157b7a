"""AdamW on fp32 main parameters, optionally sharded over data parallelism (ZeRO-1/2).

The optimizer works on *pieces*: for every bucket of every DDP gradient buffer it owns a range
``[lo, hi)`` (the whole bucket, or this rank's 1/dp shard with the distributed optimizer), and a
piece is the intersection of that range with one parameter. Each piece has fp32 views of the main
parameter, the gradient and both Adam moments. The model parameters are updated from the main
parameters after the step; with the distributed optimizer each rank updates only its shard and
the buckets' parameter storage is then all-gathered over the data-parallel group.

Memory per parameter (bf16 params, fp32 gradient buffer): 2 + 4 + 12 = 18 bytes without the
distributed optimizer; 2 + 4 + 12/dp with it (ZeRO-2 frees the 4-byte gradient between steps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mg_parallel.distributed.ddp import DistributedDataParallel
from mg_parallel.grid import ProcessGrid
from mg_parallel.optimizer.adamw import adamw_update
from mg_parallel.optimizer.clip import clip_grads, counts_in_norm, global_grad_norm, group_by_device
from mg_parallel.optimizer.config import OptimizerConfig
from mg_parallel.optimizer.loss_scaler import LossScaler
from mg_parallel.precision import Precision
from mg_parallel.tensor_parallel.utils import is_tensor_parallel

__all__ = ["MegatronStyleOptimizer", "build_optimizer"]

STATE_FORMAT = "mg-optimizer-v1"


@dataclass
class _Piece:
    """The part ``[flat_offset, flat_offset + numel)`` of one parameter's flat data this rank updates."""

    chunk: int
    name: str
    param: nn.Parameter
    flat_offset: int
    numel: int
    grad: torch.Tensor | None  # view into the DDP bucket (grad dtype); None: read from the parameter each step
    main: torch.Tensor  # fp32 view (the model param itself when it is fp32)
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    group: int
    counted: bool
    aliased: bool  # main is the fp32 model parameter itself: nothing to copy back


class MegatronStyleOptimizer:
    """AdamW with fp32 main params, loss scaling, global-norm clipping and optional ZeRO sharding.

    Build it with :func:`build_optimizer` (at tp > 1 every parameter must carry a tensor-parallel tag,
    see :func:`~mg_parallel.tensor_parallel.is_tensor_parallel`). Use per iteration: ``zero_grad()``, forward,
    ``scale_loss(loss).backward()`` (under ``no_sync()`` for all but the last micro-batch),
    ``finalize_model_grads(...)``, then ``step()``.
    """

    def __init__(self, model_chunks: list[DistributedDataParallel], grid: ProcessGrid, config: OptimizerConfig,
                 precision: Precision | None = None) -> None:
        self._setup(model_chunks, grid, config, precision)
        model_dtype = self.precision.param_dtype
        for ci, chunk in enumerate(model_chunks):
            names = {id(p): n for n, p in chunk.module.named_parameters()}
            if grid.tp_size > 1:
                # Every parameter, not only this rank's pieces: dp peers own different pieces, and all
                # ranks must fail together rather than leave some waiting in a collective.
                for p in chunk.parameters_with_grad():
                    is_tensor_parallel(p, names[id(p)])
            for buf in chunk.buffers:
                if buf.param_dtype != model_dtype:
                    raise ValueError(
                        f"optimizer.precision={config.precision!r} but model chunk {ci} has {buf.param_dtype} "
                        f"parameters; cast the model with .to({model_dtype}) before wrapping it, or change precision"
                    )
                for bucket in buf.buckets:
                    self._add_bucket(ci, chunk, buf, bucket, names)
        self._dedupe_groups()

    def _setup(self, model_chunks: list[Any], grid: ProcessGrid, config: OptimizerConfig,
               precision: Precision | None) -> None:
        self.chunks = model_chunks
        self.grid = grid
        self.config = config
        self.distributed = config.use_distributed_optimizer
        self.sharded = self.distributed
        """Each data-parallel rank holds a different part of the gradients (the norm sums over dp too)."""
        self.step_count = 0
        if precision is None:
            precision = config.precision_policy()
        elif precision.name != config.precision:
            raise ValueError(f"precision={precision.name!r} but optimizer.precision={config.precision!r}; pass the "
                             f"policy of the config (config.precision_policy()), or set optimizer.precision to match")
        self.precision = precision
        """The precision policy: the one given, else ``config.precision_policy()``."""
        self.scaler: LossScaler | None = self.precision.build_loss_scaler()
        base = {"lr": config.lr, "betas": (config.adam_beta1, config.adam_beta2), "eps": config.adam_eps}
        self.param_groups: list[dict[str, Any]] = [
            {**base, "name": "decay", "weight_decay": config.weight_decay, "params": []},
            {**base, "name": "no_decay", "weight_decay": 0.0, "params": []},
        ]
        self.pieces: list[_Piece] = []
        self._main_shards: list[torch.Tensor] = []  # fp32 copies of low-precision shards
        self._moments: list[torch.Tensor] = []

    def _dedupe_groups(self) -> None:
        for g in self.param_groups:  # each parameter once per group (pieces are per bucket)
            g["params"] = list({id(p): p for p in g["params"]}.values())

    def _add_bucket(self, ci: int, chunk: DistributedDataParallel, buf: Any, bucket: Any, names: dict[int, str]) -> None:
        lo, hi = chunk.local_shard(bucket)
        n = hi - lo
        exp_avg = torch.zeros(n, dtype=self.precision.main_param_dtype, device=bucket.grad_data.device)
        exp_avg_sq = torch.zeros_like(exp_avg)
        self._moments += [exp_avg, exp_avg_sq]
        main_shard = None
        if buf.param_dtype != self.precision.main_param_dtype:
            main_shard = torch.zeros_like(exp_avg)
            self._main_shards.append(main_shard)
        for p in bucket.params:
            slot = buf.slots[id(p)]
            ps, pe = slot.start - bucket.start, slot.end - bucket.start
            s, e = max(ps, lo), min(pe, hi)
            if s >= e:
                continue
            flat = p.data.view(-1)[s - ps : e - ps]
            if main_shard is None:
                main = flat  # fp32 model: update the parameter (or its slot in the param buffer) in place
            else:
                main = main_shard[s - lo : e - lo]
                main.copy_(flat)
            decay = p.ndim >= 2 or self.config.decay_1d_params
            group = 0 if decay else 1
            self.param_groups[group]["params"].append(p)
            self.pieces.append(
                _Piece(
                    chunk=ci, name=names[id(p)], param=p, flat_offset=s - ps, numel=e - s,
                    grad=bucket.grad_data[s:e], main=main,
                    exp_avg=exp_avg[s - lo : e - lo], exp_avg_sq=exp_avg_sq[s - lo : e - lo],
                    group=group, counted=counts_in_norm(p, self.grid, sharded_over_dp=self.distributed, name=names[id(p)]),
                    aliased=main_shard is None,
                )
            )

    # ------------------------------------------------------------------ public API
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale`` for fp16; ``loss`` unchanged otherwise."""
        return loss if self.scaler is None else loss * self.scaler.scale

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 unless fp16)."""
        return 1.0 if self.scaler is None else self.scaler.scale

    def zero_grad(self) -> None:
        """Zero every chunk's gradient buffers."""
        for chunk in self.chunks:
            chunk.zero_grad_buffer()

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Copy the model's current parameters into the fp32 main params.

        Call after loading model weights without optimizer state (e.g. fine-tuning from a
        checkpoint): otherwise the next step would start from the stale main copies of
        bf16/fp16 parameters. A no-op for fp32 models, whose main params are the parameters.
        """
        for piece in self.pieces:
            if not piece.aliased:
                piece.main.copy_(piece.param.data.view(-1)[piece.flat_offset : piece.flat_offset + piece.numel])

    def state_bytes(self) -> int:
        """Bytes of optimizer-owned state on this rank: fp32 main copies and both Adam moments."""
        return sum(t.numel() * t.element_size() for t in self._main_shards + self._moments)

    @torch.no_grad()
    def step(self, *, host_sync: bool = True) -> tuple[bool, float | torch.Tensor]:
        """Unscale, check overflow (fp16), clip, AdamW-update, copy to the model and all-gather.

        Call after ``finalize_model_grads``. Collective over every rank.

        Args:
            host_sync: False keeps the step on the device: ``grad_norm`` comes back as a 0-dim tensor and
                clipping scales by a factor computed there. Only fp16's overflow check reads a value back
                (whether every rank skips the step).

        Returns:
            ``(applied, grad_norm)``: ``applied`` is False when an fp16 overflow was found on any
            rank (then every rank skips the step and ``grad_norm`` is ``inf``); ``grad_norm`` is
            the global L2 norm of the unscaled gradients before clipping.
        """
        grads = [g.float() if g.dtype != torch.float32 else g for g in self._grads()]
        if self.scaler is not None:
            found = torch.zeros((), dtype=torch.float32, device=self.grid.device)
            for dev_grads in group_by_device(grads).values():
                # Unscales and flags inf/nan in one pass; the flag stays on the device (one host sync).
                flag = torch.zeros((), dtype=torch.float32, device=dev_grads[0].device)
                inv = torch.full((), 1.0 / self.scaler.scale, dtype=torch.float32, device=flag.device)
                torch._amp_foreach_non_finite_check_and_unscale_(dev_grads, flag, inv)
                found += flag.to(found.device)
            # Every rank (all tp/pp/cp/dp peers) must agree to skip, or parameters would diverge.
            if self.grid.world_size > 1:
                dist.all_reduce(found, op=dist.ReduceOp.MAX)
            overflow = bool(found.item() > 0)
            self.scaler.update(overflow)
            if overflow:
                self._release_grads()
                return False, math.inf
        norm = global_grad_norm(grads, [p.counted for p in self.pieces], self.grid, sharded_over_dp=self.sharded,
                                host_sync=host_sync)
        if self.config.clip_grad > 0:
            clip_grads(grads, norm, self.config.clip_grad)
        self.step_count += 1
        self._adamw(grads)
        copies = [(p.param.data.view(-1)[p.flat_offset : p.flat_offset + p.numel], p.main)
                  for p in self.pieces if not p.aliased]
        if copies:
            dst, src = zip(*copies)
            torch._foreach_copy_(list(dst), list(src))
        self._release_grads()
        if self.distributed:
            for chunk in self.chunks:
                chunk.start_param_sync(overlap=self.config.overlap_param_gather)
        return True, norm

    def _grads(self) -> list[torch.Tensor]:
        """Every piece's gradient, aligned with ``self.pieces``."""
        return [p.grad for p in self.pieces]

    def _release_grads(self) -> None:
        for chunk in self.chunks:
            chunk.release_grad_buffers()

    def _adamw(self, grads: list[torch.Tensor]) -> None:
        # torch.optim.AdamW's update, one multi-tensor call per parameter group and device.
        lists: dict[tuple[int, torch.device], tuple[list[torch.Tensor], ...]] = {}
        for piece, g in zip(self.pieces, grads):
            p, m, v, gs = lists.setdefault((piece.group, piece.main.device), ([], [], [], []))
            p.append(piece.main)
            m.append(piece.exp_avg)
            v.append(piece.exp_avg_sq)
            gs.append(g)
        for (gi, _), (p, m, v, gs) in lists.items():
            group = self.param_groups[gi]
            beta1, beta2 = group["betas"]
            adamw_update(p, gs, m, v, step=self.step_count, lr=group["lr"], beta1=beta1, beta2=beta2,
                         eps=group["eps"], weight_decay=group["weight_decay"])

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Optimizer state with every sharded tensor described as a slice of a parameter.

        Structure (see the package README)::

            {"format": "mg-optimizer-v1", "step": int, "distributed": bool,
             "param_groups": [{"name", "lr", "weight_decay", "betas", "eps"}, ...],
             "loss_scaler": {...} | None,
             "chunks": [ {param_name: {"shape": [...], "flat_offset": int, "numel": int,
                                       "main_param": fp32[numel], "exp_avg": fp32[numel],
                                       "exp_avg_sq": fp32[numel]}, ...}, ... ]}

        ``shape`` is the parameter's (tensor-parallel local) shape; the three tensors are the
        range ``[flat_offset, flat_offset + numel)`` of the parameter's flattened state. Parameters
        (or parts) owned by other data-parallel ranks are absent.
        """
        chunks: list[dict[str, Any]] = [{} for _ in self.chunks]
        for piece in self.pieces:
            entry = chunks[piece.chunk].setdefault(piece.name, {"shape": list(piece.param.shape), "pieces": []})
            entry["pieces"].append(piece)
        out_chunks: list[dict[str, Any]] = []
        for chunk in chunks:
            out: dict[str, Any] = {}
            for name, entry in chunk.items():
                ps = sorted(entry["pieces"], key=lambda x: x.flat_offset)
                out[name] = {
                    "shape": entry["shape"], "flat_offset": ps[0].flat_offset, "numel": sum(x.numel for x in ps),
                    "main_param": torch.cat([x.main.detach().clone() for x in ps]),
                    "exp_avg": torch.cat([x.exp_avg.clone() for x in ps]),
                    "exp_avg_sq": torch.cat([x.exp_avg_sq.clone() for x in ps]),
                }
            out_chunks.append(out)
        return {
            "format": STATE_FORMAT, "step": self.step_count, "distributed": self.distributed,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "loss_scaler": None if self.scaler is None else self.scaler.state_dict(),
            "chunks": out_chunks,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load :meth:`state_dict` output for the *current* layout (collective with the
        distributed optimizer: the loaded main params are all-gathered into the model).

        Raises:
            ValueError: unknown format, or a parameter's slice (offset/size/shape) differs from
                this rank's layout (the state was saved with another layout: reshard it first).
        """
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"optimizer state has format {state.get('format')!r}, expected {STATE_FORMAT!r}")
        if len(state["chunks"]) != len(self.chunks):
            raise ValueError(f"optimizer state has {len(state['chunks'])} model chunks, this model has {len(self.chunks)}")
        self.step_count = int(state["step"])
        for g, sg in zip(self.param_groups, state["param_groups"]):
            g.update({k: (tuple(v) if k == "betas" else v) for k, v in sg.items()})
        if self.scaler is not None and state.get("loss_scaler") is not None:
            self.scaler.load_state_dict(state["loss_scaler"])
        cursor: dict[tuple[int, str], int] = {}
        for piece in sorted(self.pieces, key=lambda x: (x.chunk, x.name, x.flat_offset)):
            entry = state["chunks"][piece.chunk].get(piece.name)
            if entry is None:
                raise ValueError(f"optimizer state lacks parameter {piece.name!r} (chunk {piece.chunk})")
            key = (piece.chunk, piece.name)
            start = cursor.get(key, 0)
            if list(entry["shape"]) != list(piece.param.shape) or entry["flat_offset"] + start != piece.flat_offset:
                raise ValueError(
                    f"optimizer state for {piece.name!r} covers offset {entry['flat_offset']} of shape {entry['shape']}, "
                    f"but this rank owns offset {piece.flat_offset} of {list(piece.param.shape)}; the checkpoint was "
                    f"saved with another parallel layout: reshard it (mg-ckpt) before loading"
                )
            for field in ("main_param", "exp_avg", "exp_avg_sq"):
                src = entry[field][start : start + piece.numel]
                if src.numel() != piece.numel:
                    raise ValueError(f"optimizer state {piece.name!r}.{field} has too few elements for this layout")
                dst = piece.main if field == "main_param" else getattr(piece, field)
                dst.copy_(src)
            cursor[key] = start + piece.numel
        for piece in self.pieces:
            if not piece.aliased:
                piece.param.data.view(-1)[piece.flat_offset : piece.flat_offset + piece.numel].copy_(piece.main)
        if self.distributed:
            for chunk in self.chunks:
                chunk.start_param_sync(overlap=False)


def build_optimizer(model_chunks: list[nn.Module] | nn.Module, grid: ProcessGrid, config: OptimizerConfig, *,
                    precision: Precision | None = None) -> MegatronStyleOptimizer:
    """Build the optimizer for this rank's DDP-wrapped model chunks, or for FSDP-sharded ones
    (:class:`~mg_parallel.distributed.fsdp.FullyShardedChunk`: an :class:`~mg_parallel.optimizer.fsdp.FSDPOptimizer`).

    ``precision`` is the policy the model was built and wrapped with (its loss scaling builds fp16's scaler);
    None makes it from ``config`` (:meth:`OptimizerConfig.precision_policy`).

    Raises:
        ValueError: ``precision`` is not ``config.precision``'s policy (its name differs); a chunk is neither a
            :class:`DistributedDataParallel` nor a ``FullyShardedChunk`` (or chunks mix the two), or its
            ``use_distributed_optimizer`` disagrees with ``config.use_distributed_optimizer``, or
            (tp > 1) a parameter has no tensor-parallel tag (the message names it).
    """
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    sharded = [getattr(c, "fully_sharded", False) for c in chunks]
    if any(sharded):
        from mg_parallel.optimizer.fsdp import FSDPOptimizer

        if not all(sharded):
            raise ValueError("some model chunks are FullyShardedChunk and some are not; shard all or none")
        return FSDPOptimizer(chunks, grid, config, precision)
    for i, c in enumerate(chunks):
        if not isinstance(c, DistributedDataParallel):
            raise ValueError(
                f"model chunk {i} is a {type(c).__name__}; wrap it in mg_parallel.distributed.DistributedDataParallel "
                f"(even for dp=1) before build_optimizer"
            )
        if c.use_distributed_optimizer != config.use_distributed_optimizer:
            raise ValueError(
                f"model chunk {i} was wrapped with use_distributed_optimizer={c.use_distributed_optimizer} but "
                f"optimizer.use_distributed_optimizer={config.use_distributed_optimizer}; pass the same value to both"
            )
    return MegatronStyleOptimizer(chunks, grid, config, precision)
