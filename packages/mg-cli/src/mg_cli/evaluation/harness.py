"""An lm-evaluation-harness model for mg models: ``MgLM`` implements the harness's ``LM`` interface.

    import lm_eval
    from mg_cli.evaluation.harness import MgLM
    lm = MgLM.from_checkpoint("ckpt", batch_size=8)
    lm_eval.simple_evaluate(model=lm, tasks=["my_task"], task_manager=lm_eval.tasks.TaskManager(include_path="tasks/"))

Requests are scored by :class:`~mg_cli.evaluation.lm.LMScorer`, which follows the harness's
conventions (context/continuation split, end-of-document prefix, left truncation, rolling windows),
so scores agree with the harness's ``hf`` backend on the same weights and tokenizer. The
``lm-eval`` package is an optional extra (``pip install 'mg-cli[eval]'``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mg_cli.evaluation.lm import LMScorer

__all__ = ["MgLM", "run_harness_tasks"]  # noqa: F822 (MgLM is built on first access, see __getattr__)


def _lm_eval() -> Any:
    try:
        import lm_eval
        import lm_eval.api.model
    except ImportError:
        raise ImportError("--harness-task needs lm-evaluation-harness: pip install 'mg-cli[eval]'") from None
    return lm_eval


def _base() -> type:
    return _lm_eval().api.model.LM


class _MgLMMixin:
    """The three request types of the harness's ``LM`` on an :class:`LMScorer`."""

    scorer: LMScorer
    max_gen_toks: int = 256

    def loglikelihood(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``(sum of log-probabilities, greedy)`` of each request's continuation given its context."""
        return [(s.total, s.greedy) for s in self.scorer.loglikelihood([tuple(r.args) for r in requests])]

    def loglikelihood_rolling(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[float]:
        """Total log-likelihood of each request's text, in windows of the context length."""
        docs = [self.scorer.tokenizer.encode(r.args[0]) for r in requests]
        return [s.total for s in self.scorer.rolling(docs)]

    def generate_until(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled) continuations, cut at the first stop string (``until``, plus end of document)."""
        tok = self.scorer.tokenizer
        eos = tok.decode([tok.eod]) if tok.eod is not None else None
        out: list[str] = [""] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            kwargs = dict(r.args[1] or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            if eos and eos not in until:
                until.append(eos)
            key = (tuple(until), int(kwargs.get("max_gen_toks", self.max_gen_toks)),
                   float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0)
            groups.setdefault(key, []).append(i)
        for (until, max_new, temperature), idx in groups.items():
            prompts = [tok.encode(requests[i].args[0]) or [self.scorer.prefix_token] for i in idx]
            gens = self.scorer.generate(prompts, max_new, temperature=temperature,
                                        stop_token_ids=() if tok.eod is None else (tok.eod,))
            for i, ids in zip(idx, gens):
                text = tok.decode([t for t in ids if t != tok.eod])
                cut = min((p for p in (text.find(u) for u in until if u) if p >= 0), default=len(text))
                out[i] = text[:cut]
        return out


def _make_class() -> type:
    class MgLM(_MgLMMixin, _base()):
        """lm-evaluation-harness ``LM`` over an mg model (any layout) and its tokenizer."""

        def __init__(self, scorer: LMScorer, max_gen_toks: int = 256) -> None:
            super().__init__()
            self.scorer, self.max_gen_toks = scorer, max_gen_toks

        @classmethod
        def from_checkpoint(cls, checkpoint: str | os.PathLike[str], *, tokenizer_model: str | None = None,
                            batch_size: int = 8, max_gen_toks: int = 256) -> Any:
            """An adapter for an mg checkpoint or a Hugging Face directory, in this process."""
            from mg_cli.evaluation.layouts import build_runner
            from mg_cli.evaluation.runner import default_tokenizer
            from mg_data import build_tokenizer

            runner, extra, _ = build_runner(checkpoint)
            path = tokenizer_model or default_tokenizer(checkpoint, extra)
            if path is None:
                raise ValueError(f"{checkpoint} records no tokenizer; pass tokenizer_model")
            return cls(LMScorer(runner, build_tokenizer(path), batch_size=batch_size), max_gen_toks)

        @property
        def rank(self) -> int:
            return self.scorer.runner.dp_rank

        @property
        def world_size(self) -> int:
            return 1  # the scorer already spreads requests over data-parallel ranks and gathers them

    return MgLM


_CLASS: type | None = None


def __getattr__(name: str) -> Any:  # MgLM subclasses lm_eval's LM, so it is built when first asked for
    global _CLASS
    if name == "MgLM":
        if _CLASS is None:
            _CLASS = _make_class()
        return _CLASS
    raise AttributeError(name)


def run_harness_tasks(scorer: LMScorer, tasks: Sequence[str], *, limit: int | None = None,
                      batch_size: int = 8) -> list[dict[str, Any]]:
    """Run lm-evaluation-harness tasks (names, or YAML files whose directory is added to the task path) on
    ``scorer``'s model; one result per task in ``mg eval``'s form, metrics as the harness names them.

    Raises:
        ImportError: lm-eval is not installed. ValueError: an unknown task.
    """
    lm_eval = _lm_eval()
    from lm_eval.tasks import TaskManager

    names, include = [], []
    for t in tasks:
        if t.endswith((".yaml", ".yml")):
            p = Path(t)
            if not p.is_file():
                raise ValueError(f"--harness-task {t}: no such file")
            include.append(str(p.resolve().parent))
            import yaml

            names.append(yaml.safe_load(p.read_text())["task"])
        else:
            names.append(t)
    # Indexing the harness's own task folders takes tens of seconds; skip it when only files are named.
    manager = TaskManager(include_path=include or None, include_defaults=len(include) < len(names))
    lm = __getattr__("MgLM")(scorer)
    out = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit,
                                  batch_size=batch_size, bootstrap_iters=0, log_samples=False)
    results = []
    for name in names:
        r = out["results"][name]
        metrics = {}
        for key, value in r.items():
            metric, _, flt = key.partition(",")
            if metric.endswith("_stderr") or metric == "alias" or not isinstance(value, (int, float)):
                continue
            stderr = r.get(f"{metric}_stderr,{flt}")
            metrics[metric] = {"value": float(value),
                               "stderr": float(stderr) if isinstance(stderr, (int, float)) else None}
        n = out.get("n-samples", {}).get(name, {})
        results.append({"task": f"harness/{name}", "kind": "harness", "file": name,
                        "num_examples": int(n.get("effective", n.get("original", 0))), "metrics": metrics})
    return results
