"""Fully sharded data parallelism: PyTorch's FSDP2 (``fully_shard``) applied to a model from outside.

:func:`apply_fsdp` shards every transformer block, then the root, over a ``DeviceMesh`` built from
the grid's own data-parallel group (``dp_cp_group`` when cp > 1), so tensor-parallel shards of mg's
layers stay local to their tp rank and FSDP splits each of them further over dp (2-D: tp x dp).
``shard_size=N`` gives hybrid sharding (HSDP): shard within groups of N data-parallel ranks and
replicate (all-reduce) across them. Parameters stay in the precision policy's main dtype (fp32) as
DTensor shards; compute runs in the policy's compute dtype (FSDP's ``MixedPrecisionPolicy``).

The rest of the training loop uses these helpers: :func:`no_gradient_sync` for gradient
accumulation, :func:`fsdp_grad_norm` / :func:`clip_fsdp_grads` for the global norm over DTensor
gradient shards, :func:`finalize_fsdp_grads` for sequence-parallel and pipeline-tied gradients,
:func:`check_fsdp` for config validation and :func:`memory_bytes` for per-rank memory.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from mg_parallel.collectives import all_reduce_coalesced
from mg_parallel.distributed.fsdp_mesh import check_fsdp, data_parallel_rank_lists, fsdp_mesh
from mg_parallel.grid import ProcessGrid
from mg_parallel.optimizer.clip import clip_grads, counts_in_norm, global_grad_norm
from mg_parallel.precision import Precision
from mg_parallel.tags import is_sequence_parallel, is_shared_embedding

__all__ = [
    "FullyShardedChunk",
    "apply_fsdp",
    "check_fsdp",
    "clip_fsdp_grads",
    "data_parallel_rank_lists",
    "finalize_fsdp_grads",
    "fsdp_grad_norm",
    "fsdp_mesh",
    "local_flat_range",
    "local_tensor",
    "memory_bytes",
    "no_gradient_sync",
    "replicas",
]

# Python attributes mg keeps on parameters (tensor-parallel tags, sequence parallel, tied embeddings);
# fully_shard replaces every parameter with a new DTensor parameter, so they are carried over.
_PARAM_TAGS = ("tensor_parallel", "partition_dim", "sequence_parallel", "shared_embedding")


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The children of every outermost ``nn.ModuleList`` or ``nn.ModuleDict`` in ``model`` (its transformer
    layers)."""
    out: list[nn.Module] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in inside):
            continue
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            inside.append(name)
            out.extend(module.values() if isinstance(module, nn.ModuleDict) else module)
    return out


def _check_units(model: nn.Module, units: list[nn.Module]) -> None:
    """Raise ValueError when a parameter (a tied weight) would belong to two FSDP units.

    FSDP2 itself only finds out in the first forward ("shared with a parameter already managed by
    another FSDP group"); this names the parameter and the fix before anything is sharded.
    """
    unit_of: dict[int, int] = {}
    for i, unit in enumerate(units):
        for module in unit.modules():
            unit_of[id(module)] = i
    owner: dict[int, tuple[int, str]] = {}
    for module_name, module in model.named_modules():
        u = unit_of.get(id(module), -1)  # -1: the root unit
        for name, p in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            if owner.setdefault(id(p), (u, full))[0] != u:
                first = owner[id(p)][1]
                raise ValueError(
                    f"parameter {full!r} is the same tensor as {first!r}, but they would be sharded in different "
                    f"FSDP units (tied weights must be gathered together); keep both modules out of `blocks` "
                    f"so the root unit holds them, or put the modules sharing it in one block"
                )


def apply_fsdp(
    model: nn.Module,
    grid: ProcessGrid,
    precision: Precision | str = "fp32",
    *,
    shard_size: int | None = None,
    offload: bool = False,
    reshard_after_forward: bool = True,
    blocks: Sequence[nn.Module] | None = None,
) -> nn.Module:
    """Shard ``model`` with FSDP2 over the grid's data-parallel ranks, block by block, then the root.

    Each block (``blocks``, or else every child of every outermost ``nn.ModuleList`` or ``nn.ModuleDict`` in
    ``model``, i.e. the transformer layers) becomes one FSDP unit whose parameters are all-gathered before its
    forward and backward and reduce-scattered after its backward; the root unit holds the rest
    (embeddings, final norm, output head, and a tied output weight together with its embedding).
    Each parameter is split along dim 0 over the data-parallel ranks (uneven sizes are padded);
    tensor-parallel shards of mg's layers are split further, each tp rank on its own dp group.
    Parameters become ``DTensor`` s (``param.to_local()`` is this rank's shard) and keep mg's tags
    (``tensor_parallel``, ``partition_dim``, ``sequence_parallel``, ``shared_embedding``).

    Args:
        model: the full (unsharded) model in the policy's main dtype (fp32), on ``grid.device``.
            Build it identically on every rank; it is sharded in place.
        grid: the process grid; FSDP runs over ``dp_group`` (``dp_cp_group`` when cp > 1).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (or a :class:`~mg_parallel.precision.Precision`):
            parameters are all-gathered and computed in its compute dtype; gradients are
            reduced and accumulated in its grad-reduce dtype (fp32). fp16 needs a loss scaler in
            the training loop (not provided here).
        shard_size: HSDP: shard over groups of this many data-parallel ranks, replicate across
            groups (see :func:`fsdp_mesh`); None shards over all of them.
        offload: keep sharded parameters, gradients and optimizer state on the CPU
            (``CPUOffloadPolicy``; the optimizer step then runs on the CPU). On a CPU-only grid
            everything already lives there, so this changes no placement.
        reshard_after_forward: free the gathered parameters after each block's forward (gathered
            again for backward; ZeRO-3). False keeps them until backward (ZeRO-2-like, more memory).
        blocks: the modules to shard as separate units, instead of the ``ModuleList`` rule.

    Returns:
        ``model`` itself, now an ``FSDPModule`` (``set_requires_gradient_sync`` etc. available).

    Raises:
        ValueError: torch.distributed is not initialised, ``shard_size`` does not divide dp*cp,
            the model's floating-point parameters are not in the policy's main dtype, or a tied
            parameter would be split between two units (tied weights must stay in one unit).
    """
    policy = Precision.resolve(precision)
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != policy.main_param_dtype:
            raise ValueError(
                f"parameter {name!r} is {p.dtype}, but apply_fsdp keeps the sharded parameters as the "
                f"{policy.name} policy's main parameters ({policy.main_param_dtype}) and casts to "
                f"{policy.compute_dtype} only for compute; do not cast the model before apply_fsdp"
            )
    units = list(blocks) if blocks is not None else _blocks(model)
    _check_units(model, units)
    mesh = fsdp_mesh(grid, shard_size)
    low = policy.compute_dtype != policy.main_param_dtype
    mp_policy = MixedPrecisionPolicy(
        param_dtype=policy.compute_dtype if low else None,
        reduce_dtype=policy.grad_reduce_dtype if low else None,
    )
    offload_policy = CPUOffloadPolicy(pin_memory=grid.device.type == "cuda") if offload else OffloadPolicy()
    tags = {name: {k: getattr(p, k) for k in _PARAM_TAGS if hasattr(p, k)} for name, p in model.named_parameters()}
    kwargs = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    for i, block in enumerate(units):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        fully_shard(block, reshard_after_forward=reshard_after_forward and i < len(units) - 1, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)
    for name, p in model.named_parameters():
        for k, v in tags.get(name, {}).items():
            setattr(p, k, v)
    return model


@contextlib.contextmanager
def no_gradient_sync(*models: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally, without FSDP's reduce-scatter, inside the block.

    Use it for every micro-batch but the last; the last backward (outside the block) reduces the
    accumulated unsharded gradients once::

        for i, micro in enumerate(micro_batches):
            with no_gradient_sync(model) if i < len(micro_batches) - 1 else contextlib.nullcontext():
                (model(micro) / len(micro_batches)).backward()

    ``models`` are FSDP-sharded models (:func:`apply_fsdp`); others are ignored. Unsharded gradients
    are held between micro-batches (the memory of one unsharded copy of the gradients).
    """
    fsdp = [m for m in models if isinstance(m, FSDPModule)]
    for m in fsdp:
        m.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        for m in fsdp:
            m.set_requires_gradient_sync(True)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a ``DTensor``, else ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_flat_range(t: torch.Tensor) -> tuple[int, int]:
    """``[lo, hi)``: where this rank's local shard lies in the flattened full tensor (``(0, numel)`` if not a DTensor).

    FSDP splits dim 0 into chunks of ``ceil(rows / n)`` rows over the n ranks of its shard mesh dimension (the
    last ranks may get fewer, or none), so a shard is a contiguous run of the flattened tensor.

    Raises:
        ValueError: the DTensor is not sharded along dim 0 on one mesh dimension (not an FSDP parameter).
    """
    if not isinstance(t, DTensor):
        return 0, t.numel()
    shards = [(d, p) for d, p in enumerate(t.placements) if not p.is_replicate()]
    if len(shards) != 1 or not shards[0][1].is_shard(0):
        raise ValueError(f"expected a DTensor sharded along dim 0 on one mesh dimension (FSDP), got {t.placements}")
    dim = shards[0][0]
    rows = t.shape[0]
    per = math.ceil(rows / t.device_mesh.size(dim))
    first = min(t.device_mesh.get_local_rank(dim) * per, rows)
    row = t.numel() // rows if rows else 0
    local = t.to_local()
    if local.shape[0] != min(first + per, rows) - first:
        raise ValueError(f"local shard of {tuple(local.shape)} does not start at row {first} of {tuple(t.shape)}")
    return first * row, first * row + local.numel()


def replicas(t: torch.Tensor) -> tuple[int, int]:
    """``(index, count)`` of this rank among the ranks holding the same shard of ``t`` (HSDP's replicate
    dimensions of a DTensor's mesh); ``(0, 1)`` for a plain tensor or full sharding."""
    return _replica_rank(t), _replica_count(t)


def _replica_count(t: torch.Tensor) -> int:
    if not isinstance(t, DTensor):
        return 1
    return math.prod(t.device_mesh.size(d) for d, p in enumerate(t.placements) if p.is_replicate())


def _replica_rank(t: torch.Tensor) -> int:
    """This rank's index along the replicate dimensions of a DTensor's mesh (0 when none)."""
    if not isinstance(t, DTensor):
        return 0
    index = 0
    for dim, placement in enumerate(t.placements):
        if placement.is_replicate():
            index = index * t.device_mesh.size(dim) + t.device_mesh.get_local_rank(dim)
    return index


def fsdp_grad_norm(models: Iterable[nn.Module], grid: ProcessGrid) -> float:
    """Global L2 norm of the gradients of FSDP-sharded ``models``, each element counted once.

    A collective over all ranks. Every rank sums the squares of its local gradient shards that
    count: data-parallel shards are disjoint (all count; under HSDP only replicate index 0 does),
    tensor-parallel shards are distinct (all count), tp-replicated parameters count on tp rank 0
    and a pipeline-tied embedding on the first stage (the rules of
    :func:`mg_parallel.optimizer.clip.counts_in_norm`); the sum runs over the world.

    Raises:
        ValueError: at tp > 1 a parameter has no tensor-parallel tag.
    """
    grads, counted = _counted_grads(models, grid)
    return global_grad_norm(grads, counted, grid, sharded_over_dp=True)


def clip_fsdp_grads(models: Iterable[nn.Module], grid: ProcessGrid, max_norm: float) -> float:
    """Clip the gradients of ``models`` to global norm ``max_norm`` (torch's rule); returns the norm.

    The norm is :func:`fsdp_grad_norm`; every local shard is scaled by
    ``min(1, max_norm / (norm + 1e-6))``. A collective over all ranks.
    """
    grads, counted = _counted_grads(models, grid)
    norm = global_grad_norm(grads, counted, grid, sharded_over_dp=True)
    clip_grads(grads, norm, max_norm)
    return norm


def _counted_grads(models: Iterable[nn.Module], grid: ProcessGrid) -> tuple[list[torch.Tensor], list[bool]]:
    grads, counted = [], []
    seen: set[int] = set()
    for model in models:
        for name, p in model.named_parameters():
            if p.grad is None or id(p) in seen:
                continue
            seen.add(id(p))
            grads.append(local_tensor(p.grad))
            counted.append(_replica_rank(p.grad) == 0 and counts_in_norm(p, grid, sharded_over_dp=True, name=name))
    return grads, counted


def finalize_fsdp_grads(model_chunks: Sequence[nn.Module], grid: ProcessGrid) -> None:
    """Finish gradients that FSDP's reduce-scatter over dp does not: sequence parallelism and tied stages.

    Call after the last backward of a step (pass it as a pipeline schedule's ``finalize_grads``).
    Every tp (and pipeline) peer shards a parameter the same way over its own dp group, so the
    local shards line up and are summed directly:

    * ``sequence_parallel`` parameters: partial gradients summed over ``grid.tp_group``;
    * ``shared_embedding`` parameters with pp > 1: summed over ``grid.embedding_group`` (first and
      last stage).
    """
    params = []
    seen: set[int] = set()
    for chunk in model_chunks:
        for p in chunk.parameters():
            if p.grad is not None and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    if grid.tp_size > 1:
        all_reduce_coalesced([local_tensor(p.grad) for p in params if is_sequence_parallel(p)],
                             grid.tp_group)
    if grid.embedding_group is not None and (grid.is_first_stage or grid.is_last_stage):
        all_reduce_coalesced([local_tensor(p.grad) for p in params if is_shared_embedding(p)],
                             grid.embedding_group)


def memory_bytes(models: Iterable[nn.Module], optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state, from their tensor storages.

    Each storage is counted once (tied parameters, views of one buffer), at its current size: a
    storage FSDP has freed (resized to 0 after resharding) counts 0. DTensors count their local
    shard, padding included.

    Returns:
        ``{"params": int, "grads": int, "optimizer": int, "total": int}`` in bytes.
    """
    seen: set[tuple[int, int]] = set()

    def count(tensors: Iterable[torch.Tensor]) -> int:
        total = 0
        for t in tensors:
            storage = local_tensor(t).untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if storage.nbytes() and key not in seen:
                seen.add(key)
                total += storage.nbytes()
        return total

    params = [p for m in models for p in m.parameters()]
    out = {"params": count(params), "grads": count(p.grad for p in params if p.grad is not None)}
    state = optimizer.state.values() if optimizer is not None else []
    out["optimizer"] = count(v for s in state for v in s.values() if isinstance(v, torch.Tensor))
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


class FullyShardedChunk(nn.Module):
    """A model chunk sharded by :func:`apply_fsdp`, with the interface that mg's pipeline schedules and
    :func:`~mg_parallel.optimizer.build_optimizer` use for a :class:`DistributedDataParallel` chunk.

    ``module`` is the sharded model; ``no_sync()`` defers FSDP's reduce-scatter to the last micro-batch
    (schedules enter it for the others); ``zero_grad_buffer()`` drops the gradient shards. Gradients are
    reduce-scattered during backward, so ``finish_grad_sync()`` has nothing left to wait for; run
    :func:`finalize_fsdp_grads` (the schedules' ``finalize_grads``) for the tensor- and pipeline-parallel
    fix-ups.

    Args:
        module: the full model chunk in the policy's main dtype (fp32); sharded in place.
        grid, precision, shard_size, offload, reshard_after_forward: as for :func:`apply_fsdp`;
            ``reshard_after_forward`` defaults to resharding only without pipeline parallelism.
    """

    fully_sharded = True
    """Tells :func:`~mg_parallel.optimizer.build_optimizer` to build an FSDP optimizer."""
    use_distributed_optimizer = False
    """FSDP shards the state itself; mg's distributed optimizer is never combined with it."""

    def __init__(self, module: nn.Module, grid: ProcessGrid, precision: Precision | str = "fp32", *,
                 shard_size: int | None = None, offload: bool = False, reshard_after_forward: bool | None = None
                 ) -> None:
        super().__init__()
        # Under a pipeline schedule several micro-batches are between forward and backward at once; keeping
        # a stage's parameters gathered until their backward saves an all-gather per micro-batch (None: pp == 1).
        reshard = grid.pp_size == 1 if reshard_after_forward is None else reshard_after_forward
        self.precision = Precision.resolve(precision)
        """The precision policy: fp32 shards, gathered and computed in its compute dtype."""
        self.module = apply_fsdp(module, grid, self.precision, shard_size=shard_size, offload=offload,
                                 reshard_after_forward=reshard)
        self.shard_size = shard_size or grid.dp_size * grid.cp_size
        """Ranks each parameter is split over (all data-parallel ranks unless hybrid-sharded)."""
        self.offload = offload

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with warnings.catch_warnings():
            # Models return views (per-token losses as [b, s] of an [s, b] result); FSDP warns that an in-place
            # op on one would skip its backward hook, and neither mg's schedules nor its losses do that.
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
            return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate unsharded gradients locally; the next backward outside the block reduce-scatters them."""
        with no_gradient_sync(self.module):
            yield

    def finish_grad_sync(self) -> None:
        """Nothing to wait for: FSDP's reduce-scatter has finished when backward returns."""

    def reshard(self) -> None:
        """Free every gathered parameter, leaving the shards as the chunk's parameters.

        Units that keep their parameters gathered from forward to backward (the last block; every unit under
        pipeline parallelism) stay gathered after a forward-only pass: call this after evaluation, before
        anything reads the parameters as shards (the optimizer, a checkpoint).
        """
        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def zero_grad_buffer(self) -> None:
        """Drop the gradient shards (the next backward allocates them)."""
        self.module.zero_grad(set_to_none=True)

    release_grad_buffers = zero_grad_buffer
