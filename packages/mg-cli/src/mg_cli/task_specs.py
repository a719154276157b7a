"""``--task KIND:PATH`` specs (``mg eval --task``, ``eval.tasks``): the kinds and their parsing, with no reader or
model behind them, so the configuration can check them before anything runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["KINDS", "TaskSpec", "parse_task"]

KINDS: dict[str, str] = {
    "perplexity": "JSONL of {text} or a dataset prefix (PREFIX_text_document): NLL per token, perplexity, bits/byte",
    "choice": "JSONL of {context, choices, answer}: acc and acc_norm by log-likelihood",
    "cloze": "JSONL of {context, target} (or {text}: its last word, LAMBADA-style): greedy-match acc, perplexity",
    "classification": "JSONL of {text, text_pair?, label} for a classification head: accuracy, macro-F1",
    "seq2seq": "JSONL of {input, target}: greedy generation, exact match, token F1, BLEU, chrF",
    "sft": "JSONL of conversations ({messages} or {prompt, completion}): loss over assistant tokens",
    "humaneval": "JSONL of {prompt, test, entry_point}: pass@k of generated programs (--allow-code-execution)",
}
"""Task kinds and what each reads and reports."""


@dataclass(frozen=True)
class TaskSpec:
    """One ``--task KIND:PATH`` (``name`` is what results are reported under)."""

    kind: str
    path: str
    name: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"--task {self.kind}:{self.path}: unknown kind {self.kind!r}; use one of "
                             f"{', '.join(KINDS)}")
        if not self.name:
            object.__setattr__(self, "name", f"{self.kind}/{Path(self.path).name.removesuffix('.jsonl')}")


def parse_task(text: str) -> TaskSpec:
    """``KIND:PATH`` (optionally ``NAME=KIND:PATH``) -> :class:`TaskSpec`.

    Raises:
        ValueError: no ``:``, an unknown kind (listing the valid ones).
    """
    name, _, rest = text.rpartition("=") if "=" in text.split(":", 1)[0] else ("", "", text)
    kind, sep, path = rest.partition(":")
    if not sep or not path:
        raise ValueError(f"--task {text!r}: write KIND:PATH, KIND one of {', '.join(KINDS)}")
    return TaskSpec(kind=kind, path=path, name=name)
