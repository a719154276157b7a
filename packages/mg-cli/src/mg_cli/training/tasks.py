"""``eval.tasks``: `mg eval`'s tasks run on the model being trained, at every evaluation.

The training chunk itself is evaluated at the training layout (its tensor-parallel shard; pipeline
stages pass hidden states along; data-parallel replicas split the examples) with a context of
``model.seq_length`` tokens, by the same :class:`~mg_cli.evaluation.evaluate.Evaluator` as ``mg eval``,
so a metric logged at iteration N is what ``mg eval --max-length SEQ_LENGTH`` reports on the
checkpoint of iteration N. Each metric is logged as ``eval/<task>/<metric>``.
"""

from __future__ import annotations

import os
from typing import Any

from mg_cli.training.setup import TrainingError


def parse_tasks(config: Any) -> list[Any]:
    """The ``TaskSpec`` of each ``eval.tasks`` entry, checked against the run (before any collective).

    Raises:
        TrainingError: a malformed entry, a missing file, or a layout in-loop evaluation does not run at.
    """
    from mg_cli.evaluation.tasks import parse_task

    specs = []
    for text in config.eval.tasks:
        try:
            spec = parse_task(text)
        except ValueError as e:
            raise TrainingError(f"eval.tasks: {e}") from None
        if not os.path.exists(spec.path):
            raise TrainingError(f"eval.tasks: {spec.path} does not exist (in {text!r})")
        specs.append(spec)
    if specs and config.parallel.vpp > 1:
        raise TrainingError("eval.tasks runs on one model chunk per rank; set parallel.vpp: 1 or leave eval.tasks "
                            "empty")
    return specs


class LoopTasks:
    """The ``eval.tasks`` of a run; calling it evaluates them all on the current weights (collective)."""

    def __init__(self, run: Any, specs: list[Any]) -> None:
        from mg_cli.evaluation.evaluate import Evaluator
        from mg_cli.evaluation.layouts import PipelineRunner
        from mg_cli.evaluation.lm import LMScorer
        from mg_cli.evaluation.options import EvalOptions
        from mg_cli.evaluation.runner import ModelRunner
        from mg_models.loading import unwrap

        grid = run.grid
        self.model = unwrap(run.model[0])  # the DDP wrapper's chunk
        cls = PipelineRunner if grid.pp_size > 1 else ModelRunner
        self.runner = cls(self.model, max_length=run.config.model.seq_length,
                          dp_group=grid.dp_group if grid.dp_size > 1 else None)
        self.runner.grid = grid
        self.model.train()  # the runner switches it to eval mode; it does so again for each evaluation
        scorer = LMScorer(self.runner, run.tokenizer, batch_size=run.config.train.micro_batch_size)
        # eval.allow_code_execution was checked at start (EvalKeys): humaneval tasks run only with it.
        self.evaluator = Evaluator(scorer, EvalOptions(allow_code_execution=run.config.eval.allow_code_execution))
        self.specs = specs

    def __call__(self) -> dict[str, float]:
        """``{"eval/<task>/<metric>": value}`` of every task.

        Raises:
            TrainingError: a malformed task file or a task this model cannot run (one line).
        """
        import torch

        from mg_cli.evaluation.tasks import TaskFileError

        self.model.eval()
        out: dict[str, float] = {}
        try:
            with torch.no_grad():
                for spec in self.specs:
                    result = self.evaluator.run(spec)
                    out.update({f"eval/{spec.name}/{k}": float(m["value"]) for k, m in result["metrics"].items()})
        except (TaskFileError, ValueError) as e:
            raise TrainingError(f"eval.tasks: {str(e).splitlines()[0]}") from None
        finally:
            self.model.train()
        return out
