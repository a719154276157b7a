"""Pre-norm transformer layer and layer stack, assembled from :class:`~mg_models.spec.ModuleSpec` s."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mg_models.init import normal_init, scaled_std
from mg_models.layers import MLP, SelfAttention, SelfAttentionSubmodules, norm_class
from mg_models.spec import BuildContext, ModuleSpec, build_module
from mg_parallel.moe import MoEGroups, MoELayer
from mg_parallel.tags import global_block
from mg_parallel.tensor_parallel.utils import group_rank, group_size

__all__ = ["MoEMLP", "TransformerBlock", "TransformerLayer", "TransformerLayerSubmodules", "gpt_layer_spec"]


@dataclass
class TransformerLayerSubmodules:
    """The parts of a pre-norm layer: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``; ``moe_mlp`` replaces
    ``mlp`` on the layers ``config.moe_layer_pattern`` marks."""

    input_layernorm: ModuleSpec | type
    self_attention: ModuleSpec | type
    pre_mlp_layernorm: ModuleSpec | type
    mlp: ModuleSpec | type
    moe_mlp: ModuleSpec | type | None = None


def gpt_layer_spec(ctx: BuildContext, grid: Any = None) -> ModuleSpec:
    """The GPT layer spec for ``ctx.config``: norm type, qk-layernorm, attention and MLP classes; with
    ``config.num_experts``, :class:`MoEMLP` on the MoE layers (its ep/etp groups from ``grid``, a ProcessGrid)."""
    norm = norm_class(ctx)
    qk_norm = norm if ctx.config.qk_layernorm else None
    attention = ModuleSpec(SelfAttention, submodules=SelfAttentionSubmodules(q_layernorm=qk_norm, k_layernorm=qk_norm))
    moe = ModuleSpec(MoEMLP, params={"grid": grid}) if getattr(ctx.config, "is_moe", False) else None
    return ModuleSpec(TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=norm, self_attention=attention, pre_mlp_layernorm=norm, mlp=MLP, moe_mlp=moe))


class MoEMLP(MoELayer):
    """The MLP of an MoE layer: :class:`mg_parallel.moe.MoELayer` with the config's sizes and router options.

    Tensors (unsharded names under ``prefix``): ``router.weight [N, h]``, ``experts.w1 [N, h, 2, f]`` (gate, up;
    ``[N, h, f]`` for GeLU), ``experts.w2 [N, f, h]``, and with a shared expert ``shared_experts.w1 [1, h, 2, f_s]``,
    ``shared_experts.w2 [1, f_s, h]`` and ``shared_gate.weight [1, h]``. Each global tensor is drawn from
    ``(seed, its global name)`` and this rank keeps its block, so every ep/etp layout holds slices of the same
    model; ``w2`` (into the residual stream) uses the scaled output std like the dense MLP's ``linear_fc2``.

    Args:
        ctx: the build context (config, tp group, sequence parallelism, seed, device, dtype).
        prefix: global name of this module (keys the initialisation).
        grid: the ProcessGrid whose ep, etp, cp and dp groups the layer uses; None: one process (with ctx's tp group).

    Raises:
        ValueError: ep does not divide ``model.num_experts`` or etp the expert FFN size (from MoELayer).
    """

    def __init__(self, ctx: BuildContext, prefix: str, grid: Any = None) -> None:
        c = ctx.config
        groups = (MoEGroups.from_grid(grid) if grid is not None
                  else MoEGroups(tp_group=ctx.tp_group, sequence_parallel=ctx.sequence_parallel))
        groups = dataclasses.replace(groups, sequence_parallel=ctx.sequence_parallel)
        super().__init__(c.hidden_size, c.moe_ffn_size, c.num_experts, c.moe_config(), groups=groups,
                         init_method=lambda w: None, dtype=ctx.dtype, device=ctx.device)
        out_std = scaled_std(c.init_method_std, c.num_layers) if c.scaled_output_init else c.init_method_std
        tp, tp_rank = group_size(groups.expert_tp_group), group_rank(groups.expert_tp_group)
        for name, p in self.named_parameters():
            if p.device.type == "meta":
                continue
            shape, offset = global_block(p, tp, tp_rank)
            full = torch.empty(shape, dtype=torch.float32)
            normal_init(ctx.seed, f"{prefix}.{name}", out_std if name.endswith("w2") else c.init_method_std)(full)
            for d, (start, size) in enumerate(zip(offset, p.shape)):
                full = full.narrow(d, start, size)
            with torch.no_grad():
                p.copy_(full)


class TransformerLayer(nn.Module):
    """One pre-norm decoder layer. ``layer_number`` is the global (0-based) layer index."""

    def __init__(self, ctx: BuildContext, prefix: str, layer_number: int,
                 submodules: TransformerLayerSubmodules) -> None:
        super().__init__()
        self.ctx = ctx
        self.layer_number = layer_number
        self.hidden_dropout = ctx.config.hidden_dropout
        self.input_layernorm = build_module(submodules.input_layernorm, ctx, f"{prefix}.input_layernorm")
        self.self_attention = build_module(submodules.self_attention, ctx, f"{prefix}.self_attention",
                                           layer_number=layer_number)
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, ctx, f"{prefix}.pre_mlp_layernorm")
        moe = bool(getattr(ctx.config, "moe_layer_pattern", None) and ctx.config.moe_layer_pattern[layer_number])
        if moe and submodules.moe_mlp is None:
            raise ValueError(f"layer {layer_number} is an MoE layer (model.num_experts, model.moe_layer_freq) but the "
                             f"layer spec has no moe_mlp; build it with gpt_layer_spec or set moe_mlp")
        self.mlp = build_module(submodules.moe_mlp if moe else submodules.mlp, ctx, f"{prefix}.mlp")
        for norm in (self.input_layernorm, self.pre_mlp_layernorm):
            ctx.mark_partial_grads(norm, ctx.sequence_parallel)

    def _dropout_add(self, branch: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.training and self.hidden_dropout > 0:
            # Sequence-parallel activations differ per tp rank, so their dropout masks must too.
            ctx = self.ctx.tp_rng() if self.ctx.sequence_parallel else contextlib.nullcontext()
            with ctx:
                branch = F.dropout(branch, self.hidden_dropout, training=True)
        return residual + branch

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                mask: torch.Tensor | None = None, cache: object | None = None) -> torch.Tensor:
        """x [s(/tp), b, h] -> same shape."""
        x = self._dropout_add(self.self_attention(self.input_layernorm(x), rotary, mask, cache), x)
        return self._dropout_add(self.mlp(self.pre_mlp_layernorm(x)), x)


class TransformerBlock(nn.Module):
    """Layers ``layer_range[0] .. layer_range[1]-1`` of the stack, plus the final norm when ``post_process``.

    Layers live in ``self.layers`` keyed by their *global* index, so parameter names (and
    checkpoint keys) are the same whichever pipeline stage holds the layer. ``grid`` (a ProcessGrid) gives
    the MoE layers their expert-parallel groups.
    """

    def __init__(self, ctx: BuildContext, prefix: str, layer_range: tuple[int, int], post_process: bool,
                 layer_spec: ModuleSpec | None = None, grid: Any = None) -> None:
        super().__init__()
        self.ctx = ctx
        spec = layer_spec or gpt_layer_spec(ctx, grid)
        self.layers = nn.ModuleDict({
            str(i): build_module(spec, ctx, f"{prefix}.layers.{i}", layer_number=i) for i in range(*layer_range)
        })
        self.final_layernorm = None
        if post_process:
            self.final_layernorm = build_module(norm_class(ctx), ctx, f"{prefix}.final_layernorm")
            ctx.mark_partial_grads(self.final_layernorm, ctx.sequence_parallel)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                mask: torch.Tensor | None = None, cache: object | None = None) -> torch.Tensor:
        """x [s(/tp), b, h] -> same shape. Layers selected by ``ctx.recompute`` are recomputed in backward."""
        rc = self.ctx.recompute
        for index, layer in enumerate(self.layers.values()):
            if rc is not None and self.training and cache is None and rc.recompute_layer(index):
                from mg_parallel.recompute import recompute

                x = recompute(layer, x, rotary, mask, None, rng_tracker=self.ctx.rng_tracker)
            else:
                x = layer(x, rotary, mask, cache)
        if self.final_layernorm is not None:
            x = self.final_layernorm(x)
        return x
