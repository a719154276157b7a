"""PyTorch glue (needs the ``torch`` extra; ``import mg_data`` never imports this module)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from mg_data.sampler import GlobalBatchSampler


class TorchDataset(Dataset):
    """A map-style torch ``Dataset`` over any mg-data sample dataset (numpy dicts become tensors)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        # 0-d values (e.g. BERT's is_random) stay 0-d, so a batch of them is (B,), not (B, 1).
        return {k: torch.from_numpy(np.ascontiguousarray(v)) if np.ndim(v) else torch.as_tensor(np.asarray(v))
                for k, v in self.dataset[idx].items()}


def collate(samples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack a list of sample dicts into a batch dict (leading dimension = batch)."""
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def build_data_loader(dataset: Any, sampler: GlobalBatchSampler, num_workers: int = 0,
                      pin_memory: bool = False) -> DataLoader:
    """A ``DataLoader`` yielding this rank's micro-batches in the sampler's order.

    ``num_workers`` background processes read samples; ordering is still the sampler's.
    """
    return DataLoader(TorchDataset(dataset), batch_sampler=sampler, collate_fn=collate,
                      num_workers=num_workers, pin_memory=pin_memory,
                      persistent_workers=num_workers > 0)
