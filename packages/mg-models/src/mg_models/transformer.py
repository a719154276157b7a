"""Pre-norm transformer layer and layer stack, assembled from :class:`~mg_models.spec.ModuleSpec` s."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mg_models.layers import MLP, SelfAttention, SelfAttentionSubmodules, norm_class
from mg_models.spec import BuildContext, ModuleSpec, build_module

__all__ = ["TransformerBlock", "TransformerLayer", "TransformerLayerSubmodules", "gpt_layer_spec"]


@dataclass
class TransformerLayerSubmodules:
    """The parts of a pre-norm layer: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    input_layernorm: ModuleSpec | type
    self_attention: ModuleSpec | type
    pre_mlp_layernorm: ModuleSpec | type
    mlp: ModuleSpec | type


def gpt_layer_spec(ctx: BuildContext) -> ModuleSpec:
    """The GPT layer spec for ``ctx.config``: norm type, qk-layernorm, attention and MLP classes."""
    norm = norm_class(ctx)
    qk_norm = norm if ctx.config.qk_layernorm else None
    attention = ModuleSpec(SelfAttention, submodules=SelfAttentionSubmodules(q_layernorm=qk_norm, k_layernorm=qk_norm))
    return ModuleSpec(TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=norm, self_attention=attention, pre_mlp_layernorm=norm, mlp=MLP))


class TransformerLayer(nn.Module):
    """One pre-norm decoder layer. ``layer_number`` is the global (0-based) layer index."""

    def __init__(self, ctx: BuildContext, prefix: str, layer_number: int,
                 submodules: TransformerLayerSubmodules) -> None:
        super().__init__()
        self.ctx = ctx
        self.hidden_dropout = ctx.config.hidden_dropout
        self.input_layernorm = build_module(submodules.input_layernorm, ctx, f"{prefix}.input_layernorm")
        self.self_attention = build_module(submodules.self_attention, ctx, f"{prefix}.self_attention",
                                           layer_number=layer_number)
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, ctx, f"{prefix}.pre_mlp_layernorm")
        self.mlp = build_module(submodules.mlp, ctx, f"{prefix}.mlp")
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
    checkpoint keys) are the same whichever pipeline stage holds the layer.
    """

    def __init__(self, ctx: BuildContext, prefix: str, layer_range: tuple[int, int], post_process: bool,
                 layer_spec: ModuleSpec | None = None) -> None:
        super().__init__()
        self.ctx = ctx
        spec = layer_spec or gpt_layer_spec(ctx)
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
