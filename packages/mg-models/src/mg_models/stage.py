"""What GPT and BERT share as models that a pipeline cuts into stages.

A stage is the model built with ``pre_process`` (it holds the embedding: first stage),
``post_process`` (it holds the head: last stage) and a global ``layer_range``; a stage other than
the first reads its input from :meth:`PipelineStageModel.set_input_tensor`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mg_models.config import GPTConfig, check_parallel
from mg_models.spec import BuildContext
from mg_parallel.grid import ProcessGrid

__all__ = ["PipelineStageModel"]


class PipelineStageModel(nn.Module):
    """Base of :class:`~mg_models.gpt.GPTModel` and :class:`~mg_models.bert.BertModel`: layout checks, the
    build context and the pipeline input; the subclass builds its modules after ``super().__init__``.

    Args:
        config: the architecture.
        grid: the process grid (``ProcessGrid.single()`` when None).
        pre_process: this chunk holds the embedding (first pipeline stage).
        post_process: this chunk holds the head (last pipeline stage).
        layer_range: global ``(start, end)`` layers held here; None means all.
        sequence_parallel: split activations between tp regions along the sequence (only at tp > 1).
        seed: initialisation seed.
        rng_tracker: mg_parallel ``RNGTracker`` for dropout on tp-sharded activations.
        recompute: an mg_parallel ``RecomputeConfig``, or None.
        dtype: parameter dtype (fp32 when None).

    Raises:
        ValueError: the layout does not fit the config (names the field), or a bad layer_range.
    """

    supports_context_parallel = False
    """Whether the model runs with the sequence split over a context-parallel group (``grid.cp_size > 1``)."""

    def __init__(self, config: GPTConfig, grid: ProcessGrid | None, *, pre_process: bool, post_process: bool,
                 layer_range: tuple[int, int] | None, sequence_parallel: bool, seed: int, rng_tracker: Any,
                 recompute: Any, dtype: torch.dtype | None) -> None:
        super().__init__()
        grid = grid or ProcessGrid.single()
        check_parallel(config, grid.tp_size, grid.pp_size)
        if grid.cp_size > 1 and not self.supports_context_parallel:
            raise ValueError(f"parallel.cp={grid.cp_size}: context parallelism is only supported for GPT models for "
                             f"now; use parallel.cp: 1 for {type(self).__name__}")
        start, end = layer_range if layer_range is not None else (0, config.num_layers)
        if not 0 <= start < end <= config.num_layers:
            raise ValueError(f"layer_range=({start}, {end}) must satisfy 0 <= start < end <= model.num_layers="
                             f"{config.num_layers}")
        self.config = config
        self.grid = grid
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_range = (start, end)
        self.ctx = BuildContext(config=config, tp_group=grid.tp_group, tp_size=grid.tp_size, tp_rank=grid.tp_rank,
                                sequence_parallel=sequence_parallel and grid.tp_size > 1, cp_group=grid.cp_group,
                                cp_size=grid.cp_size, cp_rank=grid.cp_rank, cp_comm=grid.dims.cp_comm, seed=seed,
                                rng_tracker=rng_tracker, recompute=recompute, device=grid.device, dtype=dtype)
        self.input_tensor: torch.Tensor | None = None
        self.gather_logits_default = False
        """When True, forward returns full unpadded logits unless told otherwise (set when loading a checkpoint)."""

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor] | None) -> None:
        """Pipeline hook: the hidden states [s(/tp), b, h] this (non-first) stage starts from."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0] if input_tensor else None
        self.input_tensor = input_tensor

    def _batch_and_seq(self, input_ids: torch.Tensor | None) -> tuple[int, int]:
        """``(b, s)`` of this forward: from ``input_ids`` [b, s] on the first stage, else from the input tensor
        [s(/tp), b, h] (s is the full sequence).

        Raises:
            ValueError: no ``input_ids`` on the first stage, no input tensor on another, or (sequence
                parallelism) a sequence length not divisible by tp.
        """
        if self.pre_process:
            if input_ids is None:
                raise ValueError("input_ids are required on the first pipeline stage")
            b, s = input_ids.shape
        else:
            if self.input_tensor is None:
                raise ValueError("a non-first pipeline stage needs set_input_tensor(hidden) before forward")
            s_local, b = self.input_tensor.shape[:2]
            s = s_local * (self.ctx.tp_size if self.ctx.sequence_parallel else 1)
        if self.ctx.sequence_parallel and s % self.ctx.tp_size != 0:
            raise ValueError(f"sequence length {s} must be divisible by tp={self.ctx.tp_size} with sequence parallelism")
        return b, s
