"""Regional compilation: ``torch.compile`` applied to each transformer layer, not to the whole model.

Identical layers share one compiled graph (torch treats their parameters as graph inputs), so a
model compiles in about the time of one layer whatever its depth, and everything around the
layers (embeddings, the head and loss, the pipeline schedule, gradient hooks, collectives between
steps) stays eager. A call that passes something other than tensors (an inference cache during
generation) runs the eager layer, so decoding neither recompiles per step nor traces the cache.
A mixture-of-experts layer compiles its attention only: the experts' routing depends on the data
(how many tokens each expert gets), which would recompile.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mg_parallel.moe import MoELayer

__all__ = ["compile_layers", "compiled_layers"]


def _tensors_only(value: Any) -> bool:
    if value is None or isinstance(value, (torch.Tensor, bool, int, float)):
        return True
    return isinstance(value, (tuple, list)) and all(_tensors_only(v) for v in value)


class _Compiled:
    """``module.forward`` replaced by the compiled forward when every argument is a tensor (or None)."""

    def __init__(self, module: nn.Module, **options: Any) -> None:
        self.eager = module.forward
        self.compiled = torch.compile(module.forward, **options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if all(_tensors_only(a) for a in args) and all(_tensors_only(v) for v in kwargs.values()):
            return self.compiled(*args, **kwargs)
        return self.eager(*args, **kwargs)


def _stack_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer layers of ``model``: the members of every ``layers`` ModuleDict / ModuleList."""
    out = []
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleDict):
            out.extend(layers.values())
        elif isinstance(layers, nn.ModuleList):
            out.extend(layers)
    return out


def _target(layer: nn.Module) -> nn.Module:
    """What of ``layer`` compiles: the layer, or the attention of a mixture-of-experts layer."""
    return layer.self_attention if isinstance(getattr(layer, "mlp", None), MoELayer) else layer


def compile_layers(model: nn.Module, **options: Any) -> int:
    """Compile each transformer layer of ``model`` (GPT, BERT, T5, any chunk of one) in place.

    ``options`` go to ``torch.compile`` (``mode``, ``backend``, ``dynamic``...). A layer whose MLP is a
    mixture of experts gets its attention compiled and its experts left eager.

    Returns:
        The number of layers compiled (0 when the model has none, e.g. a pipeline stage of only a head).
    """
    layers = _stack_layers(model)
    for layer in layers:
        target = _target(layer)
        if not isinstance(target.__dict__.get("forward"), _Compiled):
            target.forward = _Compiled(target, **options)
    return len(layers)


def compiled_layers(model: nn.Module) -> int:
    """How many transformer layers of ``model`` run compiled (the whole layer or, for MoE, its attention)."""
    return sum(isinstance(_target(layer).__dict__.get("forward"), _Compiled) for layer in _stack_layers(model))
