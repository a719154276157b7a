"""Each task kind from its file to its metrics: ``Evaluator(scorer, options).run(spec) -> result dict``.

A result is ``{"task", "kind", "file", "num_examples", "metrics": {name: {"value", "stderr"}}, ...}``
(``stderr`` is null where no standard error is defined); classification adds the confusion matrix,
humaneval the per-problem counts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mg_cli.evaluation import metrics as M
from mg_cli.evaluation.lm import LMScorer, count_windows
from mg_cli.evaluation.options import EvalOptions
from mg_cli.evaluation.tasks import (
    TaskSpec,
    read_choice,
    read_classification,
    read_cloze,
    read_code,
    read_seq2seq,
    read_texts,
)

__all__ = ["HUMANEVAL_STOPS", "EvalOptions", "Evaluator"]

HUMANEVAL_STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
"""Where a HumanEval completion ends: the function body stops at the next top-level statement."""


def _metric(value: float, stderr: float | None = None) -> dict[str, float | None]:
    return {"value": value, "stderr": stderr}


class Evaluator:
    """Runs task specs on one scorer.

    Args:
        scorer: the model and tokenizer (:class:`~mg_cli.evaluation.lm.LMScorer`).
        options: :class:`EvalOptions`.
        progress: ``progress(description, total)`` -> a context manager yielding ``update(n)``; None: silent.
    """

    def __init__(self, scorer: LMScorer, options: EvalOptions | None = None,
                 progress: Callable[[str, int], Any] | None = None) -> None:
        self.scorer, self.options = scorer, options or EvalOptions()
        self.tok = scorer.tokenizer
        self._progress = progress

    @contextmanager
    def _bar(self, desc: str, total: int) -> Iterator[None]:
        if self._progress is None:
            yield
            return
        with self._progress(desc, total) as update:
            previous, self.scorer.progress = self.scorer.progress, update
            try:
                yield
            finally:
                self.scorer.progress = previous

    def run(self, spec: TaskSpec) -> dict[str, Any]:
        """Evaluate one task; see the module docstring for the result.

        Raises:
            TaskFileError: a malformed task file (one line naming file and line).
            ValueError: the model cannot run this kind of task, or bad options.
        """
        result = getattr(self, f"_{spec.kind}")(spec)
        return {"task": spec.name, "kind": spec.kind, "file": os.fspath(spec.path), **result}

    # -- log-likelihood tasks -------------------------------------------------------------------------
    def _documents(self, path: str) -> tuple[list[list[int]], int]:
        """Token ids and total UTF-8 bytes of a JSONL's texts or a dataset prefix's documents."""
        limit = self.options.limit
        if path.endswith(".jsonl") or os.path.isfile(path):
            texts = read_texts(path, limit)
            return self.tok.encode_batch(texts), sum(len(t.encode("utf-8")) for t in texts)
        from mg_data import IndexedDataset

        if not Path(path + ".idx").is_file():
            raise ValueError(f"{path}: neither a JSONL file nor a dataset prefix ({path}.idx does not exist)")
        ds = IndexedDataset(path)
        docs, total_bytes = [], 0
        for i in range(len(ds) if limit is None else min(limit, len(ds))):
            ids = [int(t) for t in ds[i]]
            while ids and ids[-1] == self.tok.eod:  # the end-of-document marker mg preprocess appends
                ids.pop()
            if ids:
                docs.append(ids)
                total_bytes += len(self.tok.decode(ids).encode("utf-8"))
        if not docs:
            raise ValueError(f"{path}: no documents")
        return docs, total_bytes

    def _perplexity(self, spec: TaskSpec) -> dict[str, Any]:
        docs, total_bytes = self._documents(spec.path)
        s = self.scorer
        stride = self.options.stride or s.max_length
        with self._bar(spec.name, sum(count_windows(len(d), s.max_length, stride) for d in docs)):
            scores = s.rolling(docs, stride)
        nll = -math.fsum(x for sc in scores for x in sc.logprobs)
        tokens = sum(len(sc.logprobs) for sc in scores)
        return {"num_examples": len(docs), "tokens": tokens, "bytes": total_bytes, "stride": stride,
                "context_length": s.max_length,
                "metrics": {"nll_per_token": _metric(nll / tokens), "perplexity": _metric(math.exp(nll / tokens)),
                            "bits_per_byte": _metric(M.bits_per_byte(nll, total_bytes))}}

    def _choice(self, spec: TaskSpec) -> dict[str, Any]:
        examples = read_choice(spec.path, self.options.limit)
        d = self.options.target_delimiter
        pairs = [(ex.context, d + c) for ex in examples for c in ex.choices]
        with self._bar(spec.name, len(pairs)):
            scores = iter(self.scorer.loglikelihood(pairs))
        acc, acc_norm = [], []
        for ex in examples:
            lls = [next(scores).total for _ in ex.choices]
            pred, pred_norm = M.choice_predictions(lls, ex.choices)
            acc.append(float(pred == ex.answer))
            acc_norm.append(float(pred_norm == ex.answer))
        return {"num_examples": len(examples),
                "metrics": {"acc": M.MeanWithError(acc), "acc_norm": M.MeanWithError(acc_norm)}}

    def _cloze(self, spec: TaskSpec) -> dict[str, Any]:
        examples = read_cloze(spec.path, self.options.limit)
        with self._bar(spec.name, len(examples)):
            scores = self.scorer.loglikelihood([(ex.context, ex.target) for ex in examples])
        lls = [sc.total for sc in scores]
        mean_ll, _ = M.mean_stderr(lls)
        return {"num_examples": len(examples),
                "metrics": {"acc": M.MeanWithError([float(sc.greedy) for sc in scores]),
                            "perplexity": _metric(math.exp(-mean_ll)),
                            "loglikelihood": M.MeanWithError(lls)}}

    def _sft(self, spec: TaskSpec) -> dict[str, Any]:
        from mg_data.sft import load_chat_template, tokenize_jsonl

        template = load_chat_template(self.options.chat_template, getattr(self.tok, "model_path", None))
        convs = tokenize_jsonl([spec.path], self.tok, template)
        n = len(convs) if self.options.limit is None else min(self.options.limit, len(convs))
        pairs = [convs.get(i) for i in range(n)]
        pairs = [(t.tolist(), m.tolist()) for t, m in pairs if int(m[1:].sum()) > 0]
        if not pairs:
            raise ValueError(f"{spec.path}: no conversation has assistant tokens to score")
        s = self.scorer
        with self._bar(spec.name, sum(count_windows(len(t) - 1, s.max_length, s.max_length) for t, _ in pairs)):
            scores = s.rolling([t[1:] for t, _ in pairs], prefixes=[t[0] for t, _ in pairs])
        nll = -math.fsum(lp for sc, (_, m) in zip(scores, pairs) for lp, w in zip(sc.logprobs, m[1:]) if w)
        tokens = sum(sum(m[1:]) for _, m in pairs)
        return {"num_examples": len(pairs), "tokens": tokens, "chat_template": template.name,
                "metrics": {"loss": _metric(nll / tokens), "perplexity": _metric(math.exp(nll / tokens))}}

    # -- classification --------------------------------------------------------------------------------
    def _classification(self, spec: TaskSpec) -> dict[str, Any]:
        import torch

        runner = self.scorer.runner
        num_labels = int(runner.config.num_labels)
        examples = read_classification(spec.path, num_labels, self.options.limit)
        encoded = [self._classification_ids(ex.text, ex.text_pair, runner.family) for ex in examples]

        def local(items: list[tuple[list[int], list[int]]]) -> list[int]:
            preds = []
            bs = self.scorer.batch_size
            for start in range(0, len(items), bs):
                batch = items[start:start + bs]
                width = max(len(ids) for ids, _ in batch)
                ids = torch.zeros(len(batch), width, dtype=torch.long, device=runner.device)
                types = torch.zeros_like(ids)
                mask = torch.zeros_like(ids)
                for row, (toks, tt) in enumerate(batch):
                    ids[row, : len(toks)] = torch.as_tensor(toks)
                    types[row, : len(tt)] = torch.as_tensor(tt)
                    mask[row, : len(toks)] = 1
                logits = runner.classify(ids, mask, types)
                preds.extend(logits.float().argmax(-1).tolist())
                self.scorer.progress(len(batch))
            return preds

        with self._bar(spec.name, len(encoded)):
            preds = runner.map_examples(encoded, local)
        report = M.classification_report([ex.label for ex in examples], preds, num_labels)
        return {"num_examples": len(examples), "confusion_matrix": report.pop("confusion_matrix"),
                "metrics": {"accuracy": report["accuracy"], "macro_f1": _metric(report["macro_f1"])}}

    def _classification_ids(self, text: str, pair: str | None, family: Any) -> tuple[list[int], list[int]]:
        """Token ids and token types as the family's classifier reads them (BERT ``[CLS] a [SEP] (b [SEP])``; GPT
        ``a (<eod> b)``), cut to the context."""
        from mg_models.family import TokenLookup

        a = self.tok.encode(text)
        b = self.tok.encode(pair) if pair is not None else None
        ids, types = family.classification_ids(TokenLookup(self.tok), a, b, self.scorer.prefix_token)
        n = self.scorer.max_length
        if not ids:
            raise ValueError("a classification text encodes to no tokens")
        return ids[:n], types[:n]

    # -- generation tasks ------------------------------------------------------------------------------
    def _generate_texts(self, prompts: Sequence[list[int]], until: Sequence[str], desc: str,
                        temperature: float = 0.0) -> list[str]:
        eod = self.tok.eod
        with self._bar(desc, len(prompts)):
            out = self.scorer.generate(prompts, self.options.max_new_tokens, temperature=temperature,
                                       seed=self.options.seed, stop_token_ids=() if eod is None else (eod,))
        texts = []
        for ids in out:
            text = self.tok.decode([t for t in ids if t != eod])
            cut = min((i for i in (text.find(u) for u in until) if i >= 0), default=len(text))
            texts.append(text[:cut])
        return texts

    def _seq2seq(self, spec: TaskSpec) -> dict[str, Any]:
        examples = read_seq2seq(spec.path, self.options.limit)
        until = self.options.until
        if until is None:
            until = () if self.scorer.runner.family.kind == "encoder-decoder" else ("\n",)
        prompts = [self.tok.encode(ex.input) for ex in examples]
        outputs = [t.strip() for t in self._generate_texts(prompts, until, spec.name)]
        em = [M.squad_exact_match(o, ex.targets) for o, ex in zip(outputs, examples)]
        f1 = [M.squad_f1(o, ex.targets) for o, ex in zip(outputs, examples)]
        result_metrics: dict[str, Any] = {"exact_match": M.MeanWithError(em), "token_f1": M.MeanWithError(f1)}
        notes = []
        try:
            refs = [ex.targets[0].strip() for ex in examples]
            result_metrics["bleu"] = _metric(M.corpus_bleu(outputs, refs))
            result_metrics["chrf"] = _metric(M.corpus_chrf(outputs, refs))
        except ImportError as e:
            notes.append(str(e))
        return {"num_examples": len(examples), "metrics": result_metrics, "notes": notes,
                "outputs": outputs}

    def _humaneval(self, spec: TaskSpec) -> dict[str, Any]:
        from mg_cli.evaluation.execution import CodeExecutionRefused, run_program

        o = self.options
        if not o.allow_code_execution:
            raise CodeExecutionRefused(spec.path)
        problems = read_code(spec.path, o.limit)
        prompts = [self.tok.encode(p.prompt) for p in problems for _ in range(o.num_samples)]
        until = o.until if o.until is not None else HUMANEVAL_STOPS
        completions = self._generate_texts(prompts, until, spec.name, temperature=o.temperature)
        programs = [(p, completions[i * o.num_samples + j]) for i, p in enumerate(problems)
                    for j in range(o.num_samples)]
        runner = self.scorer.runner
        passed = runner.map_examples(programs, lambda items: [
            run_program(p.prompt + c + "\n\n" + p.test + "\n\n" + f"check({p.entry_point})\n", o.timeout_s)
            for p, c in items])
        correct = [sum(passed[i * o.num_samples:(i + 1) * o.num_samples]) for i in range(len(problems))]
        result_metrics = {f"pass@{k}": M.MeanWithError([M.pass_at_k(o.num_samples, c, k) for c in correct])
                          for k in o.pass_k}
        return {"num_examples": len(problems), "num_samples": o.num_samples, "metrics": result_metrics,
                "problems": [{"task_id": p.task_id, "correct": c} for p, c in zip(problems, correct)]}
