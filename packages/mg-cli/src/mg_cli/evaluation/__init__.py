"""Evaluation of mg models: perplexity, zero-shot multiple choice and cloze, fine-tuned task metrics and
code pass@k, at any parallel layout, plus an lm-evaluation-harness model adapter (``harness``).

``Evaluator(LMScorer(ModelRunner(model), tokenizer), EvalOptions(...)).run(parse_task("choice:f.jsonl"))``
evaluates one task; ``mg eval`` is the command. Nothing here imports torch at package import.
"""

from __future__ import annotations

from mg_cli.evaluation.tasks import KINDS, TaskFileError, TaskSpec, parse_task

__all__ = ["KINDS", "TaskFileError", "TaskSpec", "parse_task"]
