"""An lm-evaluation-harness model for mg models: ``MgLM`` implements the harness's ``LM`` interface.

    import lm_eval
    from mg_cli.evaluation.harness import MgLM
    lm = MgLM.from_checkpoint("ckpt", batch_size=8)
    lm_eval.simple_evaluate(model=lm, tasks=["my_task"], task_manager=lm_eval.tasks.TaskManager(include_path="tasks/"))

Requests are scored by :class:`~mg_cli.evaluation.lm.LMScorer`, which follows the harness's
conventions (context/continuation split, end-of-document prefix, left truncation, rolling windows),
so scores agree with the harness's ``hf`` backend on the same weights and tokenizer. The
``lm-eval`` package is an optional extra (``pip install 'mg-cli[eval]'``).

Under data parallelism the harness sees one process on every rank (rank 0 of 1): each rank builds
every document's requests, and the scorer deals them to the dp ranks and gathers the results back
in order, so every rank holds all responses and computes the same metrics. (The harness's own split,
rank r of n taking every n-th document, would split the requests a second time.)
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

from mg_cli.evaluation.lm import LMScorer

__all__ = ["MgLM", "check_harness_tasks", "run_harness_tasks"]  # noqa: F822 (MgLM is built on first access, see __getattr__)


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


@functools.cache  # one class: every `MgLM` names the same one
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
            """0 on every rank: each builds all requests (the scorer spreads them over dp ranks and gathers them)."""
            return 0

        @property
        def world_size(self) -> int:
            """1: the harness does not split documents over ranks (see :attr:`rank`)."""
            return 1

    return MgLM


def __getattr__(name: str) -> Any:  # MgLM subclasses lm_eval's LM, so it is built when first asked for
    if name == "MgLM":
        return _make_class()
    raise AttributeError(name)


def check_harness_tasks(tasks: Sequence[str], *, allow_code_execution: bool = False) -> None:
    """The checks of :func:`run_harness_tasks` that need no model and no index of the harness's own tasks
    (``mg eval`` runs them before starting its processes).

    Raises:
        ImportError: lm-eval is not installed. ValueError: a task file that cannot be loaded, or one that would
        run Python without ``allow_code_execution`` (one line naming the file).
    """
    _lm_eval()
    from mg_cli.evaluation.harness_yaml import prepare_tasks

    prepare_tasks(tasks, allow_code_execution=allow_code_execution, with_defaults=False)


def run_harness_tasks(scorer: LMScorer, tasks: Sequence[str], *, limit: int | None = None,
                      batch_size: int = 8, allow_code_execution: bool = False) -> list[dict[str, Any]]:
    """Run lm-evaluation-harness tasks (names, or task/group YAML files, read by the harness's loader, whose
    directories are added to the task path) on ``scorer``'s model; one result per task and per group with
    metrics, in ``mg eval``'s form, metrics as the harness names them. In a ``torch.distributed`` job every
    rank calls it and gets the same results.

    Raises:
        ImportError: lm-eval is not installed. ValueError: an unknown task, a task file that cannot be loaded,
        a task that would run Python (a ``!function``, ``unsafe_code``) without ``allow_code_execution``, or
        the harness failing to build or run a task (one line).
    """
    lm_eval = _lm_eval()
    from mg_cli.evaluation.execution import CodeExecutionRefused
    from mg_cli.evaluation.harness_yaml import prepare_tasks

    specs, manager = prepare_tasks(tasks, allow_code_execution=allow_code_execution)
    lm = __getattr__("MgLM")(scorer)
    try:
        out = lm_eval.simple_evaluate(model=lm, tasks=specs, task_manager=manager, limit=limit,
                                      batch_size=batch_size, bootstrap_iters=0, log_samples=False,
                                      confirm_run_unsafe_code=allow_code_execution)
    except (ValueError, KeyError, OSError, ImportError, AttributeError, TypeError) as e:
        text = str(e.args[0] if isinstance(e, KeyError) and e.args else e).splitlines()
        if "marked as unsafe" in (text[0] if text else ""):
            raise CodeExecutionRefused(", ".join(tasks), "a task marked unsafe_code runs the programs the model "
                                                         "writes") from None
        raise ValueError(f"--harness-task {', '.join(tasks)}: {text[0] if text else type(e).__name__}") from None
    # The harness returns results on the process with LOCAL_RANK 0 only; every rank computed the same ones.
    return _from_rank0(_results(out) if out is not None else None)


def _results(out: dict[str, Any]) -> list[dict[str, Any]]:
    """``mg eval`` results from the harness's: each task and each group with metrics, in the harness's order."""
    samples = out.get("n-samples", {})
    subtasks = out.get("group_subtasks", {})

    def examples(name: str) -> int:
        if name in samples:
            n = samples[name]
            return int(n.get("effective", n.get("original", 0)))
        return sum(examples(t) for t in subtasks.get(name, ()))

    results = []
    for name, r in out["results"].items():
        metrics = {}
        for key, value in r.items():
            metric, _, flt = key.partition(",")
            if metric.endswith("_stderr") or metric in ("alias", "name", "sample_len", "sample_count") \
                    or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            stderr = r.get(f"{metric}_stderr,{flt}")
            metrics[metric if flt in ("none", "") else f"{metric},{flt}"] = {
                "value": float(value), "stderr": float(stderr) if isinstance(stderr, (int, float)) else None}
        if metrics:
            results.append({"task": f"harness/{name}", "kind": "harness", "file": name,
                            "num_examples": examples(name), "metrics": metrics})
    return results


def _from_rank0(results: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Rank 0's results on every rank of the default process group (this process's own without one)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [results]
        dist.broadcast_object_list(box, src=0)
        results = box[0]
    if results is None:
        raise RuntimeError("lm-evaluation-harness returned no results on rank 0")
    return results
