"""Parameter tags: what mg records on a parameter about where it lives, read in this one place.

mg's layers set plain Python attributes on the parameters they make; the grad norm, the optimizer, DDP,
FSDP, the pipeline's gradient sums and checkpoints read them back through the accessors below, each with
its behaviour for an untagged parameter stated here rather than at every call:

=======================  ===================================  ==========================================
tag (attribute)          set by                               absent means
=======================  ===================================  ==========================================
``tensor_parallel``      the tp layers, :func:`set_tensor_    unknown: :func:`is_tensor_parallel` raises
                         parallel`, :func:`mark_replicated`   (guessing "replicated" for a forgotten
                                                              shard gives a wrong grad norm); at tp = 1
                                                              callers need no tag
``partition_dim``        :func:`set_tensor_parallel` (with    :func:`partition_dim` raises
                         ``tensor_parallel=True``)
``sequence_parallel``    ``mark_sequence_parallel``, the      False (the gradient is complete per rank)
                         row-parallel bias under SP, routers
``expert_parallel``      :func:`set_expert_parallel`          False (a dense parameter)
                         (``GroupedExperts``)
``num_experts``,         :func:`set_expert_parallel`          :func:`expert_layout` raises
``ep_rank``
``shared_embedding``     models (a word embedding tied to     False
                         the output layer, pp > 1)
``pipeline_replicated``  models (held by every stage, e.g.    False
                         T5's position bias tables)
``main_grad``            DDP (a view into its grad buffer)    None (the gradient is ``.grad``)
=======================  ===================================  ==========================================

**Where a parameter lives globally.** :func:`global_block` maps a parameter to the global tensor it is a
block of (experts split over ep along dim 0, tensor-parallel shards along ``partition_dim``): what
checkpoints of global tensors and layout-independent initialisation need. :func:`param_replicas` says
which of the ranks holding the same block this one is; :func:`is_fsdp` and :func:`fsdp_shard` read an
FSDP-sharded (DTensor) parameter.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

__all__ = [
    "expert_layout",
    "fsdp_shard",
    "global_block",
    "is_expert_parallel",
    "is_fsdp",
    "is_pipeline_replicated",
    "is_sequence_parallel",
    "is_shared_embedding",
    "is_tensor_parallel",
    "main_grad",
    "mark_replicated",
    "param_replicas",
    "partition_dim",
    "set_expert_parallel",
    "set_tensor_parallel",
]

Shape = tuple[int, ...]


def _tag(param: torch.Tensor, tag: str, absent: object) -> object:
    """The value of ``tag`` on ``param``, or ``absent`` when it was never set (the only read of a tag)."""
    return getattr(param, tag, absent)


# --- setters ------------------------------------------------------------------------------------------------


def set_tensor_parallel(param: torch.Tensor, partition_dim: int | None) -> torch.Tensor:
    """Tag ``param`` as split over the tensor-parallel group along ``partition_dim``, or (None) as
    replicated on every tp rank; returns ``param``."""
    param.tensor_parallel = partition_dim is not None
    if partition_dim is not None:
        param.partition_dim = partition_dim
    return param


def mark_replicated(*modules: nn.Module) -> None:
    """Tag every parameter of ``modules`` that has no tensor-parallel tag yet as replicated.

    Use it on plain torch modules inside a tensor-parallel model (norms, small replicated linears):
    their parameters are the same on every tp rank. Tags already set (a parallel layer inside one of
    ``modules``) are kept.
    """
    for module in modules:
        for p in module.parameters():
            if _tag(p, "tensor_parallel", None) is None:
                p.tensor_parallel = False


def set_expert_parallel(param: torch.Tensor, num_experts: int, ep_rank: int) -> torch.Tensor:
    """Tag ``param`` (``[E_local, ...]``, this rank's experts) as split over the expert-parallel group: the global
    tensor holds ``num_experts`` experts and this block starts at expert ``ep_rank * E_local``; returns ``param``."""
    param.expert_parallel, param.num_experts, param.ep_rank = True, num_experts, ep_rank
    return param


# --- accessors ----------------------------------------------------------------------------------------------


def is_tensor_parallel(param: torch.Tensor, name: str | None = None) -> bool:
    """``param.tensor_parallel``: True for a tp shard, False for a replicated parameter.

    Args:
        param: a parameter tagged by an mg layer, :func:`set_tensor_parallel` or :func:`mark_replicated`.
        name: the parameter's name, for the error message.

    Raises:
        ValueError: ``param`` carries no tag (names the parameter and how to tag it).
    """
    tag = _tag(param, "tensor_parallel", None)
    if tag is None:
        what = f"parameter {name!r}" if name else f"a parameter of shape {list(param.shape)}"
        raise ValueError(
            f"{what} has no tensor_parallel tag, so at tp > 1 it is unknown whether it is a shard; build it "
            f"from mg_parallel.tensor_parallel layers, or tag its module with "
            f"mg_parallel.tensor_parallel.mark_replicated(module) when it is the same on every tp rank"
        )
    return bool(tag)


def partition_dim(param: torch.Tensor, name: str | None = None) -> int:
    """The dimension along which a tensor-parallel shard is split over the tp group.

    Raises:
        ValueError: ``param`` is not tagged as a tp shard (see :func:`is_tensor_parallel`), or its tag names
            no dimension.
    """
    dim = _tag(param, "partition_dim", None) if is_tensor_parallel(param, name) else None
    if dim is None:
        what = f"parameter {name!r}" if name else f"a parameter of shape {list(param.shape)}"
        raise ValueError(f"{what} is not a tensor-parallel shard with a partition_dim; tag it with "
                         f"set_tensor_parallel(param, dim)")
    return int(dim)


def is_sequence_parallel(param: torch.Tensor) -> bool:
    """True when ``param`` is replicated over tp but sees only this rank's tokens (sequence parallelism), so its
    gradient is a partial sum over the tp group; False when untagged."""
    return bool(_tag(param, "sequence_parallel", False))


def is_expert_parallel(param: torch.Tensor) -> bool:
    """True for the weights of local experts (split over the ep group, not replicated over dp); False when
    untagged (a dense parameter)."""
    return bool(_tag(param, "expert_parallel", False))


def expert_layout(param: torch.Tensor) -> tuple[int, int]:
    """``(num_experts, ep_rank)`` of an expert parameter: the global expert count and this rank's ep index.

    Raises:
        ValueError: ``param`` is not an expert parameter (see :func:`is_expert_parallel`).
    """
    if not is_expert_parallel(param):
        raise ValueError(f"a parameter of shape {list(param.shape)} is not an expert parameter (no expert_parallel tag)")
    return int(param.num_experts), int(param.ep_rank)


def is_shared_embedding(param: torch.Tensor) -> bool:
    """True for a word embedding tied to the output layer and held by the first and the last pipeline stage
    (gradients summed over both); False when untagged."""
    return bool(_tag(param, "shared_embedding", False))


def is_pipeline_replicated(param: torch.Tensor) -> bool:
    """True for a parameter every pipeline stage holds (gradients summed over pp, saved and counted in the grad
    norm once, by the first stage); False when untagged."""
    return bool(_tag(param, "pipeline_replicated", False))


def main_grad(param: torch.Tensor) -> torch.Tensor | None:
    """DDP's fp32 (or grad-reduce dtype) gradient of ``param``, a view into its buffer; None without DDP."""
    return _tag(param, "main_grad", None)


# --- where a parameter lives globally -------------------------------------------------------------------------


def global_block(param: torch.Tensor, tp_size: int = 1, tp_rank: int = 0, *, name: str | None = None
                 ) -> tuple[Shape, Shape]:
    """The global shape of ``param`` and the offset of this rank's block in it.

    An expert parameter (``[E_local, ...]``) is block ``ep_rank`` of ``num_experts`` along dim 0; a
    tensor-parallel shard is part ``tp_rank`` of ``tp_size`` along its ``partition_dim`` (both apply to an
    expert split by expert tensor parallelism); anything else is its own global tensor.

    Args:
        param: a tagged parameter (or a tensor carrying the same tags).
        tp_size, tp_rank: the tensor-parallel group the shards are split over (the expert tp group for
            experts); at ``tp_size`` 1 no tensor-parallel tag is read.
        name: the parameter's name, for error messages.

    Returns:
        ``(global_shape, global_offset)``, one entry per dimension.

    Raises:
        ValueError: at ``tp_size`` > 1, ``param`` has no tensor-parallel tag (see :func:`is_tensor_parallel`).
    """
    shape, offset = list(param.shape), [0] * param.dim()
    if is_expert_parallel(param):
        num_experts, ep_rank = expert_layout(param)
        offset[0], shape[0] = ep_rank * shape[0], num_experts
    if tp_size > 1 and is_tensor_parallel(param, name):
        d = partition_dim(param, name)
        offset[d], shape[d] = shape[d] * tp_rank, shape[d] * tp_size
    return tuple(shape), tuple(offset)


def is_fsdp(param: torch.Tensor) -> bool:
    """True for a parameter sharded by FSDP (a DTensor; none exists before FSDP imported their module, which
    takes about a second, so it is not imported here)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(param, dtensor.DTensor)


def fsdp_shard(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """This rank's FSDP shard of ``param`` as a flat tensor sharing its storage, and its flat range in the
    (tensor-parallel local) parameter."""
    from mg_parallel.distributed.fsdp import local_flat_range

    with torch.no_grad():
        return param.to_local().detach().view(-1), local_flat_range(param)


def param_replicas(param: torch.Tensor, grid: object, *, dp_sharded: bool, name: str | None = None
                   ) -> tuple[int, int]:
    """``(replica_rank, num_replicas)``: which of the ranks holding the same piece of ``param`` this one is.

    An expert is replicated over the ranks holding the same experts (``grid.expert_dp_group``) when ep > 1;
    an FSDP shard over HSDP's replicate groups; any other parameter over dp x cp; and a parameter that is not a
    tp shard over the tp group too. ``dp_sharded``: the piece is this rank's own flat range (the distributed
    optimizer's state), so dp x cp (or the expert dp group) holds no replicas of it.

    Args:
        param: a tagged parameter.
        grid: a :class:`mg_parallel.grid.ProcessGrid`.
        dp_sharded: see above.
        name: the parameter's name, for the error message.

    Raises:
        ValueError: at tp > 1, ``param`` has no tensor-parallel tag (see :func:`is_tensor_parallel`).
    """
    # (imported here: tensor_parallel.utils imports this module)
    from mg_parallel.tensor_parallel.utils import group_rank, group_size

    tp_sharded = grid.tp_size > 1 and is_tensor_parallel(param, name)
    rank, count = 0, 1
    if is_expert_parallel(param) and grid.ep_size > 1:
        if not dp_sharded:  # replicated over the ranks holding the same experts (the distributed optimizer shards there)
            rank, count = group_rank(grid.expert_dp_group), group_size(grid.expert_dp_group)
    elif is_fsdp(param):  # sharded over dp x cp, replicated across HSDP's groups
        from mg_parallel.distributed.fsdp import replicas

        rank, count = replicas(param)
    elif not dp_sharded:  # replicated over dp x cp (the distributed optimizer shards over both)
        rank, count = grid.cp_rank + grid.cp_size * grid.dp_rank, grid.dp_size * grid.cp_size
    if not tp_sharded:
        rank, count = rank * grid.tp_size + grid.tp_rank, count * grid.tp_size
    return rank, count
