"""The fine-tuning examples' configs (examples/finetune/*.yaml) load and validate, with the ``--set`` values of
every ``mg train`` command in their README, and the steps chain: each ``checkpoint.init_from`` is what an
earlier config saves, each data path is what the README's commands write. Nothing is trained."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from mg_cli.config import load_config
from tests.mg_cli.readme_blocks import shell_lines

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "finetune"
README = EXAMPLES / "README.md"

EXPECTED = {  # config: (model.type, data.format, checkpoint.init_from from this config's save)
    "pretrain.yaml": ("gpt", "pretrain", None),
    "sft.yaml": ("gpt", "sft", "pretrain.yaml"),
    "classify.yaml": ("bert", "classification", None),
    "translate.yaml": ("t5", "seq2seq", None),
    "codegen.yaml": ("gpt", "pretrain", "pretrain.yaml"),
}


def _commands() -> list[list[str]]:
    """Every shell command of the README's code blocks, split as the shell does."""
    return [shlex.split(line, comments=True) for line in shell_lines(README)]


def _train_commands() -> dict[str, list[list[str]]]:
    """config file name -> the --set values of each ``mg train --config examples/finetune/NAME`` in the README."""
    out: dict[str, list[list[str]]] = {}
    for argv in _commands():
        if argv[:2] != ["mg", "train"]:
            continue
        config = Path(argv[argv.index("--config") + 1])
        sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
        out.setdefault(config.name, []).append(sets)
    return out


def test_every_config_is_in_the_readme():
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted(EXPECTED)
    assert sorted(_train_commands()) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_loads_with_the_readme_overrides(name):
    family, data_format, init_from = EXPECTED[name]
    for sets in _train_commands()[name]:
        cfg = load_config(EXAMPLES / name, sets)
        assert cfg.model.type == family
        assert cfg.data.format == data_format
        assert cfg.train.precision == "fp32"
        if init_from is None:
            assert cfg.checkpoint.init_from is None
        else:
            assert cfg.checkpoint.init_from == load_config(EXAMPLES / init_from).checkpoint.save


def test_data_paths_are_written_by_the_readme_commands():
    """Each config's data.path (a .jsonl from make_data.py, or a prefix written by mg preprocess) and tokenizer
    (from mg tokenizer train) is produced by a command of the README."""
    written: set[str] = set()
    for argv in _commands():
        if argv[:2] == ["mg", "preprocess"]:
            prefix = argv[argv.index("--output-prefix") + 1]
            fmt = argv[argv.index("--format") + 1] if "--format" in argv else "text"
            written.add(prefix if fmt in ("sft", "classification", "seq2seq") else f"{prefix}_text_document")
        elif argv[:3] == ["mg", "tokenizer", "train"]:
            written.add(argv[argv.index("--output-prefix") + 1] + ".model")
    for name in EXPECTED:
        cfg = load_config(EXAMPLES / name)
        if not str(cfg.data.path).endswith(".jsonl"):
            assert str(cfg.data.path) in written, (name, cfg.data.path)
        if cfg.data.valid_path is not None and not cfg.data.valid_path.endswith(".jsonl"):
            assert cfg.data.valid_path in written, (name, cfg.data.valid_path)
        assert cfg.data.tokenizer_model in written, (name, cfg.data.tokenizer_model)
