"""A resumable sampler whose global batches do not depend on the parallel layout.

Global batch ``g`` is always samples ``order[g*G : (g+1)*G]`` of the dataset (``order`` is the
identity, or one seeded permutation), whatever the data-parallel size. Each rank then takes its
share of that batch (a contiguous block, or every ``dp_size``-th sample) and cuts it into
micro-batches. Resuming from ``consumed_samples`` therefore continues the same global stream
after any change of dp, tp or pp.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np


class GlobalBatchSampler:
    """Yields this rank's micro-batches (lists of sample indices), one global batch after another.

    Args:
        total_samples: samples in the dataset (``len(dataset)``).
        global_batch_size: samples per optimizer step across all data-parallel ranks.
        micro_batch_size: samples per forward pass on one rank.
        dp_rank, dp_size: this rank's data-parallel coordinates.
        consumed_samples: samples consumed before this run (a multiple of global_batch_size).
        split: ``contiguous`` (rank r takes block r of the batch) or ``strided`` (every dp_size-th).
        shuffle: serve the dataset in one seeded permutation instead of in order.
        seed: seed of that permutation.

    Raises:
        ValueError: sizes that do not divide, a rank outside ``[0, dp_size)``, or a bad
            ``consumed_samples``.
    """

    def __init__(self, *, total_samples: int, global_batch_size: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int, consumed_samples: int = 0, split: str = "contiguous", shuffle: bool = False,
                 seed: int = 0) -> None:
        if total_samples < 0:
            raise ValueError(f"total_samples must be >= 0, got {total_samples}")
        if micro_batch_size < 1 or dp_size < 1:
            raise ValueError(f"micro_batch_size ({micro_batch_size}) and dp_size ({dp_size}) must be >= 1")
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(f"global_batch_size {global_batch_size} must be a multiple of micro_batch_size * "
                             f"dp_size = {micro_batch_size * dp_size}; change one of them")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        if consumed_samples % global_batch_size or consumed_samples < 0:
            raise ValueError(f"consumed_samples {consumed_samples} must be a non-negative multiple of "
                             f"global_batch_size {global_batch_size}")
        if split not in ("contiguous", "strided"):
            raise ValueError(f"split must be 'contiguous' or 'strided', got {split!r}")
        self.total_samples = total_samples
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed_samples = consumed_samples
        self.split, self.shuffle, self.seed = split, shuffle, seed
        self._order: np.ndarray | None = None

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per global batch on each rank."""
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    @property
    def num_global_batches(self) -> int:
        """Whole global batches in the dataset (a final partial batch is dropped)."""
        return self.total_samples // self.global_batch_size

    def global_batch(self, step: int) -> np.ndarray:
        """Sample indices of global batch ``step``, shape (global_batch_size,), int64."""
        if not 0 <= step < self.num_global_batches:
            raise IndexError(f"global batch {step} out of range [0, {self.num_global_batches})")
        pos = np.arange(step * self.global_batch_size, (step + 1) * self.global_batch_size, dtype=np.int64)
        if not self.shuffle:
            return pos
        if self._order is None:
            self._order = np.random.default_rng(self.seed).permutation(self.total_samples)
        return self._order[pos].astype(np.int64)

    def micro_batches(self, step: int) -> list[list[int]]:
        """This rank's micro-batches of global batch ``step``."""
        batch = self.global_batch(step)
        if self.split == "contiguous":
            per_rank = self.global_batch_size // self.dp_size
            mine = batch[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
        else:
            mine = batch[self.dp_rank::self.dp_size]
        m = self.micro_batch_size
        return [mine[i * m:(i + 1) * m].tolist() for i in range(self.num_micro_batches)]

    def __iter__(self) -> Iterator[list[int]]:
        """Micro-batches from ``consumed_samples`` on.

        ``consumed_samples`` advances by a global batch when that batch's last micro-batch is handed
        out, so a checkpoint saved after the optimizer step records the step as consumed.
        """
        step = self.consumed_samples // self.global_batch_size
        while step < self.num_global_batches:
            micro = self.micro_batches(step)
            yield from micro[:-1]
            step += 1
            self.consumed_samples = step * self.global_batch_size
            yield micro[-1]

    def __len__(self) -> int:
        """Micro-batches left for this rank."""
        left = self.num_global_batches - self.consumed_samples // self.global_batch_size
        return max(left, 0) * self.num_micro_batches

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to resume the same global stream (layout-independent)."""
        return {"consumed_samples": self.consumed_samples, "global_batch_size": self.global_batch_size,
                "total_samples": self.total_samples, "shuffle": self.shuffle, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()`` output (possibly saved with another dp size).

        Raises:
            ValueError: the global batch size, dataset size or shuffling differ.
        """
        for k in ("global_batch_size", "total_samples", "shuffle", "seed"):
            if state[k] != getattr(self, k):
                raise ValueError(f"sampler state has {k}={state[k]} but this sampler has {getattr(self, k)}; "
                                 "the global sample stream would change")
        self.consumed_samples = int(state["consumed_samples"])
