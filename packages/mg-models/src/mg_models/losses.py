"""Micro-batch losses shared by the families' forward steps: means over one micro-batch (the schedules then
average micro-batches and data-parallel replicas, so the logged loss does not depend on the layout)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["context_parallel_masked_mean", "masked_mean", "sft_step", "token_mean", "token_step"]


def masked_mean(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``per_token`` over the positions where ``mask`` is set (0 when none is)."""
    mask = mask.float()
    return (per_token.float() * mask).sum() / mask.sum().clamp(min=1)


def context_parallel_masked_mean(per_token: torch.Tensor, mask: torch.Tensor, cp_group: Any) -> torch.Tensor:
    """This context-parallel rank's share of the masked mean over whole sequences, times cp (a collective over
    ``cp_group``).

    ``per_token`` and ``mask`` [b, s/cp] are this rank's tokens. The mask is counted over the whole sequence,
    so the cp ranks' values sum to cp times the mean one process computes; the schedules' loss average and the
    gradient average over dp x cp then give exactly its loss and gradients.
    """
    mask = mask.float()
    count = mask.sum()
    dist.all_reduce(count, group=cp_group)
    return (per_token.float() * mask).sum() * dist.get_world_size(cp_group) / count.clamp(min=1)


def token_mean(per_token: torch.Tensor, mask: torch.Tensor, cp_group: Any) -> torch.Tensor:
    """:func:`masked_mean`, or its context-parallel share when ``cp_group`` is given."""
    if cp_group is None:
        return masked_mean(per_token, mask)
    return context_parallel_masked_mean(per_token, mask, cp_group)


def token_step(batch: dict[str, torch.Tensor], chunk: Any, *, cp_group: Any = None) -> tuple[Any, Any]:
    """Causal-LM pretraining: the mean token loss over ``loss_mask``."""
    output = chunk(batch["tokens"], position_ids=batch["position_ids"], labels=batch["labels"])
    return output, lambda per_token: (token_mean(per_token, batch["loss_mask"], cp_group), {})


def sft_step(batch: dict[str, torch.Tensor], chunk: Any, *, cp_group: Any = None) -> tuple[Any, Any]:
    """Packed conversations: every stage gets their ``document_ids`` (no attention across conversations) and
    ``position_ids`` (restarting per conversation); the mean token loss over ``loss_mask``."""
    output = chunk(batch["tokens"], position_ids=batch["position_ids"], labels=batch["labels"],
                   document_ids=batch["document_ids"])
    return output, lambda per_token: (token_mean(per_token, batch["loss_mask"], cp_group), {})
