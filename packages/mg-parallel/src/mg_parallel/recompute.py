"""Activation recomputation (checkpointing) that replays dropout exactly.

``recompute(fn, *args)`` runs ``fn`` without keeping its intermediate activations and runs it
again during backward to rebuild them. For the gradients to be those of the original forward,
the replay must draw the same random numbers: the default generators (CPU and the device of
the inputs) are restored by PyTorch's checkpoint, and the named streams of an
:class:`~mg_parallel.tensor_parallel.RNGTracker` (tensor-parallel dropout) are restored here.

Two granularities, as in Megatron (Korthikanti et al., 2022):

* **full**: the model wraps a whole transformer layer for the first ``num_layers`` layers;
  only each wrapped layer's input is kept.
* **selective**: the model wraps only the core attention (``softmax(QK^T)V`` and its
  dropout), whose activations are large (``O(s^2)`` per head) but cheap to recompute.

Collectives inside ``fn`` (tensor-parallel layers) are replayed too, in the same order on
every rank, so ``fn`` may contain them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["RecomputeConfig", "recompute"]


def recompute(fn: Callable[..., Any], *args: Any, rng_tracker: Any | None = None, **kwargs: Any) -> Any:
    """Call ``fn(*args, **kwargs)``, discarding its activations and recomputing them in backward.

    Args:
        fn: the function to checkpoint (a transformer layer, or the core attention).
        args, kwargs: its inputs; tensors among them are kept for the replay.
        rng_tracker: the model's :class:`~mg_parallel.tensor_parallel.RNGTracker` when ``fn``
            forks its streams; their states at the call are restored for the replay.

    Returns:
        Whatever ``fn`` returns. With gradients disabled, ``fn`` is simply called.
    """
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if rng_tracker is None:
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    saved: dict[str, dict[str, torch.Tensor]] = {}

    @contextlib.contextmanager
    def at_forward() -> Iterator[None]:
        saved["streams"] = rng_tracker.get_state()
        yield

    @contextlib.contextmanager
    def at_replay() -> Iterator[None]:
        current = rng_tracker.get_state()
        rng_tracker.set_state(saved["streams"])
        try:
            yield
        finally:
            rng_tracker.set_state(current)

    return checkpoint(
        fn,
        *args,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=lambda: (at_forward(), at_replay()),
        **kwargs,
    )


@dataclass(kw_only=True)
class RecomputeConfig:
    """Which activations a model recomputes."""

    granularity: Literal["full", "selective"] | None = None
    """``"full"``: whole layers; ``"selective"``: core attention only; None: nothing."""
    num_layers: int | None = None
    """With ``"full"``: recompute the first this-many layers of each model chunk (None: all)."""

    def __post_init__(self) -> None:
        if self.granularity not in (None, "full", "selective"):
            raise ValueError(
                f"recompute.granularity must be 'full', 'selective' or None, got {self.granularity!r}"
            )
        if self.num_layers is not None:
            if self.num_layers < 0:
                raise ValueError(f"recompute.num_layers must be >= 0 or None (all), got {self.num_layers}")
            if self.granularity != "full":
                raise ValueError("recompute.num_layers only applies to granularity='full'; remove it or set 'full'")

    def recompute_layer(self, index: int) -> bool:
        """Whether layer ``index`` (0-based within its chunk) is wrapped whole in :func:`recompute`."""
        return self.granularity == "full" and (self.num_layers is None or index < self.num_layers)

    @property
    def recompute_core_attention(self) -> bool:
        """Whether the core attention is wrapped in :func:`recompute`."""
        return self.granularity == "selective"
