"""Task files: every malformed line is a one-line error naming the file and line; the CLI says it in one line."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from mg_cli.evaluation.tasks import (
    TaskFileError,
    parse_task,
    read_choice,
    read_classification,
    read_cloze,
    read_code,
    read_seq2seq,
    read_texts,
)
from mg_cli.main import cli

GOOD_CHOICE = {"context": "2 + 2 =", "choices": ["3", "4"], "answer": 1}


def _write(path, *lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


@pytest.mark.parametrize("bad,reason", [
    ({"choices": ["a"], "answer": 0}, "missing field 'context'"),
    ({"context": "x", "choices": [], "answer": 0}, "empty list"),
    ({"context": "x", "choices": ["a", "b"], "answer": 2}, "answer index 2 out of range for 2 choices"),
    ({"context": "x", "choices": ["a", "b"], "answer": -1}, "out of range"),
    ({"context": "x", "choices": ["a", ""], "answer": 0}, "choices[1] must be a non-empty string"),
    ({"context": "x", "choices": ["a", "b"], "answer": "c"}, "not one of the choices"),
    ({"context": "x", "choices": ["a", "b"], "answer": True}, "must be int/str"),
    ('{"context": "x", ', "malformed JSON"),
    ("[1, 2]", "expected a JSON object"),
])
def test_bad_choice_lines_name_file_and_line(tmp_path, bad, reason):
    f = _write(tmp_path / "mc.jsonl", GOOD_CHOICE, "", bad)
    with pytest.raises(TaskFileError) as e:
        read_choice(f)
    msg = str(e.value)
    assert msg.startswith(f"{f}:3: ") and reason in msg and "\n" not in msg


def test_other_kinds_check_their_fields(tmp_path):
    cases = [
        (read_cloze, {"context": "a"}, "missing field 'target'"),
        (read_cloze, {"text": "oneword"}, "at least two words"),
        (read_texts, {"text": ""}, "is empty"),
        (lambda f: read_classification(f, 2), {"text": "a", "label": 2}, "label 2 out of range"),
        (lambda f: read_classification(f, 2), {"text": "a", "label": "pos"}, "must be int"),
        (read_seq2seq, {"input": "a", "target": []}, "non-empty list"),
        (read_code, {"prompt": "def f():", "test": "x", "entry_point": "f g"}, "not a Python identifier"),
        (read_code, {"prompt": "def f():", "entry_point": "f"}, "missing field 'test'"),
    ]
    for reader, line, reason in cases:
        f = _write(tmp_path / "t.jsonl", line)
        with pytest.raises(TaskFileError, match=reason):
            reader(f)
    with pytest.raises(TaskFileError, match="no examples"):
        read_texts(_write(tmp_path / "empty.jsonl", ""))


def test_good_files_read_and_lambada_split(tmp_path):
    f = _write(tmp_path / "c.jsonl", {"text": "the cat sat on the mat"}, {"context": "a b", "target": " c"})
    (lam, plain) = read_cloze(f)
    assert (lam.context, lam.target) == ("the cat sat on the", " mat")
    assert (plain.context, plain.target) == ("a b", " c")
    assert read_choice(_write(tmp_path / "m.jsonl", {**GOOD_CHOICE, "answer": "4"}))[0].answer == 1
    assert read_seq2seq(_write(tmp_path / "s.jsonl", {"input": "q", "target": ["a", "b"]}))[0].targets == ["a", "b"]


def test_task_specs():
    assert parse_task("choice:data/hs.jsonl").name == "choice/hs"
    assert parse_task("mine=cloze:x.jsonl").name == "mine"
    with pytest.raises(ValueError, match="unknown kind 'bogus'"):
        parse_task("bogus:x.jsonl")
    with pytest.raises(ValueError, match="KIND:PATH"):
        parse_task("x.jsonl")


def test_cli_errors_are_one_line(tmp_path):
    f = _write(tmp_path / "mc.jsonl", {"context": "x", "choices": [], "answer": 0})
    runner = CliRunner()
    out = runner.invoke(cli, ["eval", "--checkpoint", str(tmp_path), "--task", f"choice:{f}"])
    assert out.exit_code == 1 and out.output.count("\n") == 1, out.output
    out = runner.invoke(cli, ["eval", "--checkpoint", str(tmp_path), "--task", f"humaneval:{f}"])
    assert out.exit_code == 1 and "--allow-code-execution" in out.output and out.output.count("\n") == 1
    out = runner.invoke(cli, ["eval", "--checkpoint", str(tmp_path), "--task", "nope:x"])
    assert out.exit_code == 1 and "unknown kind" in out.output
