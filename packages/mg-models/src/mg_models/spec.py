"""Declarative layer specs and the build context every model module receives.

A :class:`ModuleSpec` names a module class, its extra constructor arguments and the specs of its
sub-modules, so a transformer layer's parts (norm, attention, MLP) are chosen by data and an
implementation can be swapped without touching the model. Modules built from specs take a
:class:`BuildContext` (config, tensor-parallel group, seed, RNG tracker) and a global name
prefix, which keys their layout-independent initialisation.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from mg_models.config import GPTConfig

__all__ = ["BuildContext", "ModuleSpec", "build_module"]


@dataclass
class ModuleSpec:
    """A module class plus how to build it: ``module(ctx, prefix, submodules=..., **params)``."""

    module: type
    """The class to instantiate."""
    params: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of its constructor."""
    submodules: Any = None
    """Specs of its parts (a dataclass of ModuleSpec/classes), or None for a leaf."""


def build_module(spec: ModuleSpec | type, ctx: BuildContext, prefix: str, **kwargs: Any) -> torch.nn.Module:
    """Instantiate ``spec`` (a ModuleSpec or a bare class) with the context and global name prefix."""
    if isinstance(spec, type):
        return spec(ctx, prefix, **kwargs)
    if spec.submodules is not None:
        kwargs["submodules"] = spec.submodules
    return spec.module(ctx, prefix, **spec.params, **kwargs)


@dataclass
class BuildContext:
    """What every module of a model needs at construction: config and parallel placement."""

    config: GPTConfig
    tp_group: Any = None
    """Tensor-parallel process group (None: a single rank)."""
    tp_size: int = 1
    tp_rank: int = 0
    sequence_parallel: bool = False
    """Activations between layers are split along the sequence over the tp ranks."""
    cp_group: Any = None
    """Context-parallel process group (None: the whole sequence is on this rank)."""
    cp_size: int = 1
    """Ranks the sequence is split over (load-balanced chunks, see ``mg_parallel.context_parallel``)."""
    cp_rank: int = 0
    cp_comm: str = "p2p"
    """Context-parallel attention's communication (``parallel.cp_comm``): p2p, allgather or a2a."""
    seed: int = 1234
    """Initialisation seed; each parameter's values derive from (seed, its global name)."""
    rng_tracker: Any = None
    """An mg_parallel RNGTracker whose ``fork()`` gives the per-tp-rank dropout stream, or None."""
    recompute: Any = None
    """An mg_parallel ``RecomputeConfig`` (full layers or core attention), or None."""
    device: torch.device | None = None
    dtype: torch.dtype | None = None

    def tp_rng(self) -> contextlib.AbstractContextManager:
        """Context for random ops on tensor-parallel-sharded activations (differs per tp rank)."""
        if self.rng_tracker is None:
            return contextlib.nullcontext()
        return self.rng_tracker.fork()

    def mark_partial_grads(self, module: torch.nn.Module, when: bool) -> None:
        """Tag ``module``'s params ``sequence_parallel=True`` when ``when``: their grads are partial over tp
        ranks (norms under sequence parallelism) and must be all-reduced over the tp group."""
        if when:
            for p in module.parameters():
                p.sequence_parallel = True
