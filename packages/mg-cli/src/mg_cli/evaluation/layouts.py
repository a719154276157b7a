"""Building the evaluation model at a parallel layout: one process, or tp x pp x dp ranks of a job.

Every rank builds its part of the model (its tensor-parallel shard of its pipeline stage's
layers) and fills it with exactly the slices it holds: from an mg checkpoint of any layout through
mg-ckpt's resharding load (as ``mg train`` resumes), from a Hugging Face directory by slicing the
unsharded tensors. A pipeline-split model is run as a :class:`PipelineRunner`, whose forward passes
the hidden states stage to stage and gives every rank the last stage's logits.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from mg_cli.evaluation.runner import ModelRunner, decoder_start_token_id, load_model
from mg_parallel.precision import Precision

__all__ = ["PipelineRunner", "build_runner"]


def build_runner(checkpoint: str | os.PathLike[str], *, tp: int = 1, pp: int = 1, precision: Precision | str | None = None,
                 max_length: int | None = None) -> tuple[Any, dict[str, Any], dict[str, int]]:
    """``(runner, checkpoint state, {"rank", "tp", "pp", "dp", "processes"})`` for this process, its model built in
    ``precision`` (an ``mg_parallel.Precision`` or its name; None: the default dtype).

    Without ``torch.distributed`` variables (one process) the whole model runs here; otherwise the
    default process group is joined and the grid built with dp = world / (tp * pp).

    Raises:
        ValueError: a layout that does not fit the world size or the model, an unknown precision name.
    """
    from mg_cli.job import init_distributed, read_env

    env = read_env()
    if env.world_size == 1 and tp == pp == 1:
        from mg_parallel.device import local_device

        model, extra = load_model(checkpoint, precision=precision, device=local_device())
        return (ModelRunner(model, max_length=max_length, decoder_start_token_id=decoder_start_token_id(checkpoint, extra)), extra,
                {"rank": 0, "tp": 1, "pp": 1, "dp": 1, "processes": 1})
    if env.world_size % (tp * pp):
        raise ValueError(f"parallel.tp={tp} x parallel.pp={pp} does not divide {env.world_size} processes")
    init_distributed(env)
    from mg_models.config import check_parallel
    from mg_models.family import family_of
    from mg_models.loading import load_model as build_and_load
    from mg_models.loading import source_config
    from mg_parallel.grid import ParallelDims, build_grid

    config, _ = source_config(checkpoint)
    check_parallel(config, tp=tp, pp=pp)
    if family_of(config).kind == "encoder-decoder" and pp > 1:
        raise ValueError(f"parallel.pp={pp}: mg eval does not split {family_of(config).name.upper()} into pipeline "
                         f"stages; use parallel.pp=1 with tensor or data parallelism")
    grid = build_grid(ParallelDims(tp=tp, pp=pp))
    loaded = build_and_load(checkpoint, config=config, grid=grid, precision=precision, inference=True)
    model, extra = loaded.model, loaded.extra
    info = {"rank": grid.rank, "tp": tp, "pp": pp, "dp": grid.dp_size, "processes": grid.world_size}
    cls = PipelineRunner if pp > 1 else ModelRunner
    runner = cls(model, max_length=max_length, dp_group=grid.dp_group if grid.dp_size > 1 else None,
                 decoder_start_token_id=decoder_start_token_id(checkpoint, extra))
    runner.grid = grid
    return runner, extra, info


class PipelineRunner(ModelRunner):
    """A :class:`ModelRunner` over pipeline stages: each forward goes stage to stage (blocking sends of the
    ``[s, b, h]`` hidden states) and the last stage's outputs are broadcast to the whole pipeline.

    Generation recomputes the whole prefix at every step (no key/value cache across stages).
    """

    def __init__(self, model: torch.nn.Module, *, max_length: int | None = None, dp_group: Any = None,
                 decoder_start_token_id: int = 0) -> None:
        super().__init__(model, max_length=max_length, dp_group=dp_group, decoder_start_token_id=decoder_start_token_id)
        if self.family.kind == "encoder-decoder":
            raise ValueError(f"{self.family.name.upper()} evaluation does not run over pipeline stages; use "
                             f"parallel.pp=1")

    def _pipelined(self, ids: torch.Tensor, out_shape: Sequence[int], **kwargs: Any) -> torch.Tensor:
        grid, model = self.grid, self.model
        b, s = ids.shape
        hidden_dtype = next(model.parameters()).dtype
        if not grid.is_first_stage:
            x = torch.empty(s, b, self.config.hidden_size, dtype=hidden_dtype, device=self.device)
            dist.recv(x, src=grid.pp_ranks[grid.pp_rank - 1], group=grid.pp_group)
            model.set_input_tensor(x)
        out = model(ids, **kwargs)
        if not grid.is_last_stage:
            dist.send(out.contiguous(), dst=grid.pp_ranks[grid.pp_rank + 1], group=grid.pp_group)
            out = torch.empty(*out_shape, dtype=torch.float32, device=self.device)
        else:
            out = out.float().contiguous()
        dist.broadcast(out, src=grid.pp_ranks[-1], group=grid.pp_group)
        return out

    @torch.no_grad()
    def logits(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        self._check_lm()
        shape = (*ids.shape, self.config.vocab_size) if mask is None else (int(mask.sum()), self.config.vocab_size)
        return self._pipelined(ids, shape, gather_logits=True, output_mask=mask)

    @torch.no_grad()
    def classify(self, ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None
                 ) -> torch.Tensor:
        if getattr(self.config, "head", "lm") != "classification":
            return super().classify(ids, attention_mask, token_type_ids)
        shape = (ids.shape[0], self.config.num_labels)
        return self._pipelined(ids, shape, **self.family.classify_kwargs(attention_mask, token_type_ids))

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0, stop_token_ids: Sequence[int] = ()) -> list[list[int]]:
        from mg_models import SamplingConfig
        from mg_models.generation import sample_next

        config = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        generator = torch.Generator(device=self.device).manual_seed(seed) if temperature > 0 else None
        out: list[list[int]] = []
        for prompt in prompts:  # one row at a time: no padding, so each row decodes as alone
            seq, new = list(prompt), []
            for _ in range(max_new_tokens):
                ids = torch.as_tensor([seq], dtype=torch.long, device=self.device)
                last = torch.zeros_like(ids, dtype=torch.bool)
                last[0, -1] = True
                token = int(sample_next(self.logits(ids, last), config, generator)[0])  # logits [1, V]
                seq.append(token)
                new.append(token)
                if token in stop_token_ids:
                    break
            out.append(new)
        return out
