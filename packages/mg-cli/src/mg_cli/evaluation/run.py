"""``run_eval``: a checkpoint, tasks and options in, the JSON-ready report out (what ``mg eval`` calls)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from mg_cli.evaluation.evaluate import Evaluator
from mg_cli.evaluation.options import EvalOptions
from mg_cli.evaluation.tasks import TaskSpec

if TYPE_CHECKING:
    from mg_parallel.precision import Precision

__all__ = ["Layout", "run_eval"]


@dataclass(kw_only=True)
class Layout:
    """The parallel layout evaluation runs at (dp = processes / (tp * pp))."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name}={getattr(self, name)} must be >= 1")


def run_eval(checkpoint: str | os.PathLike[str], tasks: Sequence[TaskSpec], options: EvalOptions | None = None, *,
             harness_tasks: Sequence[str] = (), layout: Layout | None = None, batch_size: int = 8,
             tokenizer_model: str | None = None, precision: Precision | str = "fp32", max_length: int | None = None,
             show_progress: bool = True) -> dict[str, Any]:
    """Evaluate ``checkpoint`` (an mg checkpoint of any layout, or a Hugging Face directory) on ``tasks``.

    Runs in one process, or on every rank of a ``torch.distributed`` job (started by ``torchrun`` or
    ``mg eval --nproc-per-node``) at ``layout``; every rank returns the same report. ``precision`` is the
    ``mg_parallel.Precision`` (or its name, ``train.precision``'s values) the model is built in.

    Returns:
        ``{"checkpoint", "tokenizer", "layout", "precision", "model_config", "options", "results": [...],
        "elapsed_s"}``, one result per task (see :mod:`mg_cli.evaluation.evaluate`) then per harness task.

    Raises:
        TaskFileError: a malformed task file. ValueError: bad options, a task the model cannot run, an unknown
            precision name. mg_ckpt.CheckpointError, FileNotFoundError: an unreadable checkpoint.
    """
    from mg_cli.evaluation.layouts import build_runner
    from mg_cli.evaluation.lm import LMScorer
    from mg_cli.evaluation.report import progress_bar, silent_progress
    from mg_data import build_tokenizer
    from mg_parallel.precision import Precision

    options = options or EvalOptions()
    layout = layout or Layout()
    start = time.monotonic()
    precision = Precision.resolve(precision)
    runner, extra, info = build_runner(checkpoint, tp=layout.tp, pp=layout.pp, precision=precision,
                                       max_length=max_length)
    from mg_cli.evaluation.runner import default_tokenizer

    tokenizer_model = tokenizer_model or default_tokenizer(checkpoint, extra)
    if tokenizer_model is None:
        raise ValueError(f"{checkpoint} records no tokenizer; pass --tokenizer-model")
    tok = build_tokenizer(None, type="byte") if tokenizer_model == "byte" else build_tokenizer(tokenizer_model)
    main = info["rank"] == 0
    scorer = LMScorer(runner, tok, batch_size=batch_size)
    evaluator = Evaluator(scorer, options, progress_bar if show_progress and main else silent_progress)
    results = [evaluator.run(spec) for spec in tasks]
    if harness_tasks:
        from mg_cli.evaluation.harness import run_harness_tasks

        results += run_harness_tasks(scorer, harness_tasks, limit=options.limit, batch_size=batch_size,
                                     allow_code_execution=options.allow_code_execution)
    return {"checkpoint": os.fspath(checkpoint), "tokenizer": str(tokenizer_model),
            "layout": {k: info[k] for k in ("tp", "pp", "dp", "processes")}, "precision": precision.name,
            "model_config": runner.config.to_dict() if hasattr(runner.config, "to_dict") else str(runner.config),
            "context_length": runner.max_length, "batch_size": batch_size, "options": asdict(options),
            "results": results, "elapsed_s": round(time.monotonic() - start, 3)}
