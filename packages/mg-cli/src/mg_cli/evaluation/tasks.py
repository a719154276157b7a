"""Task files: ``--task KIND:PATH`` specs and strict JSONL readers, one record type per kind.

A malformed line (bad JSON, a missing or mistyped field, an answer index out of range, an empty
choice list) raises :class:`TaskFileError`, one line naming the file and line; nothing is skipped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from mg_cli.task_specs import KINDS, TaskSpec, parse_task

__all__ = [
    "KINDS",
    "ChoiceExample",
    "ClassificationExample",
    "ClozeExample",
    "CodeProblem",
    "Seq2SeqExample",
    "TaskFileError",
    "TaskSpec",
    "parse_task",
    "read_choice",
    "read_classification",
    "read_cloze",
    "read_code",
    "read_seq2seq",
    "read_texts",
]

class TaskFileError(ValueError):
    """A task file line is malformed; the message is one line, ``FILE:LINE: reason``."""

    def __init__(self, path: str, line: int | None, reason: str) -> None:
        self.path, self.line, self.reason = path, line, reason
        super().__init__(f"{path}:{line}: {reason}" if line is not None else f"{path}: {reason}")


def _records(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` of each non-blank line."""
    p = os.fspath(path)
    if not os.path.isfile(p):
        raise TaskFileError(p, None, "no such file")
    with open(p, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise TaskFileError(p, n, f"invalid UTF-8 at byte {e.start}") from None
            except json.JSONDecodeError as e:
                raise TaskFileError(p, n, f"malformed JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise TaskFileError(p, n, f"expected a JSON object, got {type(obj).__name__}")
            yield n, obj


def _field(obj: dict[str, Any], key: str, types: type | tuple[type, ...], path: str, line: int,
           optional: bool = False) -> Any:
    if key not in obj or obj[key] is None:
        if optional:
            return None
        raise TaskFileError(path, line, f"missing field {key!r} (has {sorted(obj)})")
    value = obj[key]
    allowed = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, allowed) or isinstance(value, bool):  # JSON true/false is no index or label
        names = "/".join(t.__name__ for t in allowed)
        raise TaskFileError(path, line, f"field {key!r} must be {names}, got {type(value).__name__}")
    return value


def _nonempty(value: str, key: str, path: str, line: int) -> str:
    if not value:
        raise TaskFileError(path, line, f"field {key!r} is empty")
    return value


def _read(path: str | os.PathLike[str], limit: int | None, parse: Any) -> list[Any]:
    out = []
    p = os.fspath(path)
    for n, obj in _records(p):
        out.append(parse(obj, p, n))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise TaskFileError(p, None, "no examples")
    return out


@dataclass(frozen=True)
class ChoiceExample:
    context: str
    choices: list[str]
    answer: int
    line: int = 0


def read_choice(path: str | os.PathLike[str], limit: int | None = None) -> list[ChoiceExample]:
    """``{context, choices, answer}`` lines: ``answer`` an index into ``choices`` or one of its strings.

    Raises:
        TaskFileError: a malformed line, an empty choice list or choice, an answer out of range.
    """
    def parse(obj: dict[str, Any], p: str, n: int) -> ChoiceExample:
        context = _field(obj, "context", str, p, n)
        choices = _field(obj, "choices", list, p, n)
        if not choices:
            raise TaskFileError(p, n, "field 'choices' is an empty list")
        for i, c in enumerate(choices):
            if not isinstance(c, str) or not c:
                raise TaskFileError(p, n, f"choices[{i}] must be a non-empty string, got {c!r}")
        answer = _field(obj, "answer", (int, str), p, n)
        if isinstance(answer, str):
            if answer not in choices:
                raise TaskFileError(p, n, f"answer {answer!r} is not one of the choices")
            answer = choices.index(answer)
        elif not 0 <= answer < len(choices):
            raise TaskFileError(p, n, f"answer index {answer} out of range for {len(choices)} choices")
        return ChoiceExample(context, choices, answer, n)

    return _read(path, limit, parse)


@dataclass(frozen=True)
class ClozeExample:
    context: str
    target: str
    line: int = 0


def read_cloze(path: str | os.PathLike[str], limit: int | None = None) -> list[ClozeExample]:
    """``{context, target}`` lines, or ``{text}`` lines split before their last word (LAMBADA): the context is
    the text up to the last space, the target that space and the last word.

    Raises:
        TaskFileError: a malformed line, an empty target, a ``text`` with a single word.
    """
    def parse(obj: dict[str, Any], p: str, n: int) -> ClozeExample:
        if "context" not in obj and "text" in obj:
            text = _field(obj, "text", str, p, n)
            head, sep, last = text.rstrip().rpartition(" ")
            if not sep or not last or not head:
                raise TaskFileError(p, n, "field 'text' needs at least two words (the last one is the target)")
            return ClozeExample(head, " " + last, n)
        context = _field(obj, "context", str, p, n)
        return ClozeExample(context, _nonempty(_field(obj, "target", str, p, n), "target", p, n), n)

    return _read(path, limit, parse)


def read_texts(path: str | os.PathLike[str], limit: int | None = None) -> list[str]:
    """The ``text`` field of each line.

    Raises:
        TaskFileError: a malformed line or an empty text.
    """
    return _read(path, limit, lambda obj, p, n: _nonempty(_field(obj, "text", str, p, n), "text", p, n))


@dataclass(frozen=True)
class ClassificationExample:
    text: str
    text_pair: str | None
    label: int
    line: int = 0


def read_classification(path: str | os.PathLike[str], num_labels: int, limit: int | None = None
                        ) -> list[ClassificationExample]:
    """``{text, text_pair?, label}`` lines with an integer ``label`` in ``0..num_labels-1``.

    Raises:
        TaskFileError: a malformed line or a label out of range.
    """
    def parse(obj: dict[str, Any], p: str, n: int) -> ClassificationExample:
        text = _field(obj, "text", str, p, n)
        pair = _field(obj, "text_pair", str, p, n, optional=True)
        label = _field(obj, "label", int, p, n)
        if not 0 <= label < num_labels:
            raise TaskFileError(p, n, f"label {label} out of range for a model with {num_labels} labels")
        return ClassificationExample(text, pair, label, n)

    return _read(path, limit, parse)


@dataclass(frozen=True)
class Seq2SeqExample:
    input: str
    targets: list[str]
    line: int = 0


def read_seq2seq(path: str | os.PathLike[str], limit: int | None = None) -> list[Seq2SeqExample]:
    """``{input, target}`` lines; ``target`` a string or a non-empty list of strings (any one is right).

    Raises:
        TaskFileError: a malformed line, an empty input.
    """
    def parse(obj: dict[str, Any], p: str, n: int) -> Seq2SeqExample:
        source = _nonempty(_field(obj, "input", str, p, n), "input", p, n)
        target = _field(obj, "target", (str, list), p, n)
        targets = [target] if isinstance(target, str) else target
        if not targets or not all(isinstance(t, str) for t in targets):
            raise TaskFileError(p, n, "field 'target' must be a string or a non-empty list of strings")
        return Seq2SeqExample(source, targets, n)

    return _read(path, limit, parse)


@dataclass(frozen=True)
class CodeProblem:
    task_id: str
    prompt: str
    test: str
    entry_point: str
    line: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def read_code(path: str | os.PathLike[str], limit: int | None = None) -> list[CodeProblem]:
    """HumanEval-format lines: ``prompt``, ``test`` (defining ``check(candidate)``), ``entry_point``,
    optional ``task_id`` (default ``line N``).

    Raises:
        TaskFileError: a malformed line or an entry point that is not an identifier.
    """
    def parse(obj: dict[str, Any], p: str, n: int) -> CodeProblem:
        prompt = _nonempty(_field(obj, "prompt", str, p, n), "prompt", p, n)
        test = _nonempty(_field(obj, "test", str, p, n), "test", p, n)
        entry = _field(obj, "entry_point", str, p, n)
        if not entry.isidentifier():
            raise TaskFileError(p, n, f"entry_point {entry!r} is not a Python identifier")
        task_id = _field(obj, "task_id", (str, int), p, n, optional=True)
        return CodeProblem(str(task_id) if task_id is not None else f"line {n}", prompt, test, entry, n)

    return _read(path, limit, parse)
