"""Global gradient norm across tensor, pipeline, context and data parallelism, and clipping.

A parameter's gradient must be counted exactly once in the global norm:

* tensor-parallel shards (``param.tensor_parallel``) are distinct on every tp rank: all count;
* replicated parameters are identical on every tp rank: only tp rank 0 counts them (at tp > 1 a
  parameter without a tensor-parallel tag is an error, see
  :func:`~mg_parallel.tensor_parallel.is_tensor_parallel`);
* the copy of a tied embedding on the last pipeline stage (``param.shared_embedding`` with
  pp > 1) repeats the first stage's: only the first stage counts it, and so does a parameter
  every stage holds (``param.pipeline_replicated``);
* without the distributed optimizer every data/context-parallel replica holds the same full
  gradients, so only context rank 0 counts and the sum runs over the model-parallel group;
  with it, the dp/cp ranks hold disjoint shards, so all count and the sum runs over every rank.
* with expert parallelism (ep > 1) the ep ranks of dp x cp hold different experts, so the sum runs
  over every rank: a dense gradient counts on data/context rank 0 only (all of them with the
  distributed optimizer), an expert gradient (``param.expert_parallel``) on expert-data-parallel
  rank 0 only (all of them with the distributed optimizer, which shards experts over that group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mg_parallel.grid import ProcessGrid
from mg_parallel.tags import is_expert_parallel, is_pipeline_replicated, is_shared_embedding
from mg_parallel.tensor_parallel.utils import group_rank, is_tensor_parallel

__all__ = ["counts_in_norm", "global_grad_norm", "clip_grads"]


def counts_in_norm(param: torch.Tensor, grid: ProcessGrid, *, sharded_over_dp: bool, name: str | None = None) -> bool:
    """Whether this rank's gradient of ``param`` contributes to the global norm (see module doc).

    Raises:
        ValueError: at tp > 1, ``param`` (called ``name``) has no tensor-parallel tag (raised on
            every tp rank alike, so none is left waiting in a collective).
    """
    if grid.tp_size > 1 and not is_tensor_parallel(param, name) and grid.tp_rank != 0:
        return False
    if grid.pp_size > 1 and not grid.is_first_stage and (is_shared_embedding(param) or is_pipeline_replicated(param)):
        return False
    if sharded_over_dp:
        return True
    if getattr(grid, "ep_size", 1) > 1:  # the norm sums over every rank: one replica counts
        if is_expert_parallel(param):
            return group_rank(grid.expert_dp_group) == 0
        return grid.cp_rank == 0 and grid.dp_rank == 0
    return grid.cp_rank == 0


def global_grad_norm(
    grads: list[torch.Tensor], counted: list[bool], grid: ProcessGrid, *, sharded_over_dp: bool,
    host_sync: bool = True,
) -> float | torch.Tensor:
    """L2 norm of all gradients of the model, over every rank (a collective on every rank): a float, or with
    ``host_sync=False`` a 0-dim fp32 tensor on the device (no wait for the device).

    Args:
        grads: this rank's (fp32) gradient tensors or pieces.
        counted: for each, whether it counts (:func:`counts_in_norm`).
        grid: the process grid.
        sharded_over_dp: the pieces are disjoint data-parallel shards (distributed optimizer).
    """
    device = grads[0].device if grads else grid.device
    total = torch.zeros((), dtype=torch.float32, device=device)
    kept = [g if g.dtype == torch.float32 else g.float() for g, c in zip(grads, counted) if c and g.numel()]
    for dev_grads in group_by_device(kept).values():
        # One multi-tensor norm per device; squaring the per-tensor norms back is exact to ~1 ulp.
        total += torch.stack(torch._foreach_norm(dev_grads)).square().sum().to(device)
    if grid.world_size > 1:
        if sharded_over_dp or getattr(grid, "ep_size", 1) > 1:
            dist.all_reduce(total)
        elif grid.model_parallel_group is not None:
            dist.all_reduce(total, group=grid.model_parallel_group)
    norm = total.sqrt()
    return float(norm) if host_sync else norm


def clip_grads(grads: list[torch.Tensor], total_norm: float | torch.Tensor, max_norm: float) -> None:
    """Scale ``grads`` in place by ``min(1, max_norm / (total_norm + 1e-6))`` (torch's rule).

    A tensor ``total_norm`` stays on the device: the factor is computed there and every gradient is scaled
    by it (by 1.0 when the norm is within ``max_norm``, which changes nothing), as ``clip_grad_norm_`` does.
    """
    if isinstance(total_norm, torch.Tensor):
        coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
        for dev_grads in group_by_device(grads).values():
            torch._foreach_mul_(dev_grads, coef.to(dev_grads[0].device))
        return
    coef = max_norm / (total_norm + 1e-6)
    if coef < 1.0:
        for dev_grads in group_by_device(grads).values():
            torch._foreach_mul_(dev_grads, coef)


def group_by_device(tensors: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """``tensors`` grouped by (device, dtype), order kept: multi-tensor ops need one of each per call."""
    out: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault((t.device, t.dtype), []).append(t)
    return out
