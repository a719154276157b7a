"""The mixture-of-experts layer: router, token dispatcher, local experts and an optional shared expert."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mg_parallel.gemm import PLAIN_GEMM, Gemm
from mg_parallel.moe.config import MoEConfig
from mg_parallel.moe.dispatcher import build_dispatcher
from mg_parallel.moe.experts import GroupedExperts
from mg_parallel.moe.router import TopKRouter
from mg_parallel.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from mg_parallel.tensor_parallel.utils import group_rank, group_size

__all__ = ["MoEGroups", "MoELayer", "moe_losses"]


class _SharedGate(nn.Linear):
    """The shared expert's gate ``[1, h]``: an ``nn.Linear`` whose matmul is its GEMM recipe's ``linear``."""

    def __init__(self, in_features: int, out_features: int, *, gemm: Gemm, **kw: object) -> None:
        super().__init__(in_features, out_features, **kw)
        self.gemm = gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [*, h] -> [*, 1]``."""
        return self.gemm.linear(x, self.weight, self.bias)


@dataclass(kw_only=True)
class MoEGroups:
    """The process groups an MoE layer uses (``MoEGroups.from_grid(grid)`` builds them from a grid)."""

    ep_group: dist.ProcessGroup | None = None
    """Ranks the experts are split over (None: all experts local)."""
    expert_tp_group: dist.ProcessGroup | None = None
    """Ranks each expert's FFN is split over (etp > 1); they must see the same tokens."""
    tp_group: dist.ProcessGroup | None = None
    """The tensor-parallel group: with sequence parallelism the layer's input is this rank's ``s/tp`` share."""
    sequence_parallel: bool = False
    """The input is split along the sequence over ``tp_group``."""
    cp_group: dist.ProcessGroup | None = None
    """The context-parallel group (the sequence is split over it)."""
    dp_group: dist.ProcessGroup | None = None
    """The data-parallel group (the global aux loss and the expert bias sum over it)."""

    @classmethod
    def from_grid(cls, grid: object) -> MoEGroups:
        """The groups of a :class:`mg_parallel.grid.ProcessGrid` (its ep, tp, cp and dp groups; etp = 1 or tp)."""
        etp = grid.dims.etp
        return cls(ep_group=grid.ep_group, expert_tp_group=grid.tp_group if etp > 1 else None, tp_group=grid.tp_group,
                   sequence_parallel=grid.dims.sequence_parallel, cp_group=grid.cp_group, dp_group=grid.dp_group)

    @property
    def gathers_sequence(self) -> bool:
        """Expert tensor parallelism under sequence parallelism: the layer all-gathers its input first."""
        return self.sequence_parallel and group_size(self.expert_tp_group) > 1

    @property
    def seq_groups(self) -> tuple[dist.ProcessGroup | None, ...]:
        """Groups over which the tokens the router sees are split (one micro-batch)."""
        split_over_tp = self.sequence_parallel and not self.gathers_sequence
        return (self.cp_group, *((self.tp_group,) if split_over_tp else ()))


class MoELayer(nn.Module):
    """A drop-in replacement for a transformer's MLP: each token goes to ``k`` of ``num_experts`` experts.

    ``y_t = sum_j p_tj * expert_{e_tj}(x_t)`` (+ ``shared(x_t)``, gated by ``sigmoid(x_t w)`` if
    enabled), the experts split over the ep group (global expert ``e`` on ep rank ``e // (N/ep)``).
    The router's auxiliary losses reach the gradients by themselves (see :mod:`mg_parallel.moe.router`);
    their values are in :func:`moe_losses`.

    Args:
        hidden_size: ``h``.
        ffn_hidden_size: each expert's FFN size ``f``.
        num_experts: ``N``.
        config: :class:`MoEConfig`.
        grid: a :class:`mg_parallel.grid.ProcessGrid` (its groups are used), or None.
        groups: explicit :class:`MoEGroups` instead of ``grid``; neither: one process.
        init_method: fills each full expert weight ``[N, ...]`` (default ``normal(0, 0.02)``).
        dtype, device: of every parameter.
        gemm: the GEMM recipe of the router, the experts and the shared expert and its gate (each holds it
            as ``gemm``; :func:`~mg_parallel.gemm.use_gemm` changes them later).

    Raises:
        ValueError: ep does not divide ``num_experts`` (names model.num_experts and parallel.ep), etp
            does not divide ``ffn_hidden_size``, or ``moe_router_topk > num_experts``.
    """

    def __init__(
        self, hidden_size: int, ffn_hidden_size: int, num_experts: int, config: MoEConfig, grid: object | None = None,
        *, groups: MoEGroups | None = None, init_method: Callable[[torch.Tensor], None] | None = None,
        dtype: torch.dtype | None = None, device: torch.device | str | None = None, gemm: Gemm = PLAIN_GEMM,
    ) -> None:
        super().__init__()
        if groups is None:
            groups = MoEGroups.from_grid(grid) if grid is not None else MoEGroups()
            device = device if device is not None else getattr(grid, "device", None)
        self.groups, self.config, self.num_experts = groups, config, num_experts
        replicated_over_tp_shards = groups.sequence_parallel and not groups.gathers_sequence
        kw = dict(dtype=dtype, device=device, gemm=gemm)
        self.router = TopKRouter(hidden_size, num_experts, config, seq_groups=groups.seq_groups,
                                 dp_groups=(groups.dp_group,), grad_average_groups=(groups.cp_group, groups.dp_group),
                                 **kw)
        if replicated_over_tp_shards:
            self.router.weight.sequence_parallel = True
        expert_kw = dict(activation=config.moe_expert_activation, tp_group=groups.expert_tp_group,
                         sequence_parallel=replicated_over_tp_shards, grouped=config.moe_grouped_gemm, **kw)
        self.experts = GroupedExperts(num_experts, hidden_size, ffn_hidden_size, ep_size=group_size(groups.ep_group),
                                      ep_rank=group_rank(groups.ep_group), init_method=init_method, **expert_kw)
        self.dispatcher = build_dispatcher(num_experts, groups.ep_group, config)
        self.shared_experts = self.shared_gate = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = GroupedExperts(1, hidden_size, config.moe_shared_expert_intermediate_size,
                                                 **expert_kw)
            for p in self.shared_experts.parameters():  # the same on every ep rank: a replicated weight
                p.expert_parallel = False
            if config.moe_shared_expert_gate:
                self.shared_gate = _SharedGate(hidden_size, 1, bias=False, **kw)
                nn.init.normal_(self.shared_gate.weight, std=0.02)
                self.shared_gate.weight.tensor_parallel = False
                if replicated_over_tp_shards:
                    self.shared_gate.weight.sequence_parallel = True

    @property
    def path(self) -> str:
        """How the experts are computed: ``"grouped_mm"`` or ``"loop"`` (for a start-up line)."""
        return self.experts.path

    @property
    def aux_loss_grad_scale(self) -> float:
        """The gradient the auxiliary losses receive in backward (multiply it as you multiply your loss)."""
        return self.router.aux_loss_grad_scale

    @aux_loss_grad_scale.setter
    def aux_loss_grad_scale(self, value: float) -> None:
        self.router.aux_loss_grad_scale = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism) or ``[T, h]`` -> the same shape.

        Collective over the ep group (and the tp group with etp > 1): every rank of it must call it.
        The all-gather dispatcher needs the same token count on every ep rank.
        """
        g = self.groups
        if g.gathers_sequence:
            x = gather_from_sequence_parallel_region(x, g.tp_group, tensor_parallel_output_grad=False)
        shape = x.shape
        seq_shape = (shape[0], shape[1]) if x.dim() == 3 else None
        tokens = x.reshape(-1, shape[-1])  # [T, h], token t = i*b + j
        probs, indices = self.router(tokens, seq_shape)
        rows, per_expert = self.dispatcher.dispatch(tokens, probs, indices)
        out = self.dispatcher.combine(self.experts(rows, per_expert))
        if self.shared_experts is not None:
            shared = self.shared_experts(tokens, torch.tensor([tokens.shape[0]], device=tokens.device))
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(tokens)) * shared
            out = out + shared
        out = out.view(shape)
        if g.gathers_sequence:
            out = scatter_to_sequence_parallel_region(out, g.tp_group)
        return out


def moe_losses(model: nn.Module) -> dict[str, torch.Tensor]:
    """The auxiliary losses of the last forward, averaged over the MoE layers of ``model`` (detached).

    Keys: ``"load_balancing_loss"`` and/or ``"z_loss"`` (those enabled); empty without MoE layers.
    """
    sums: dict[str, list[torch.Tensor]] = {}
    for m in model.modules():
        if isinstance(m, TopKRouter):
            for key, value in m.losses.items():
                sums.setdefault(key, []).append(value)
    return {key: torch.stack(values).mean() for key, values in sums.items()}
