"""Shared fixtures: a JSONL corpus built from the standard library's sources and a tokenizer trained on it."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from mg_data.tokenizers import train_sentencepiece


def stdlib_sources(max_bytes: int) -> list[tuple[str, str]]:
    """(name, text) of top-level standard-library modules, sorted by name, up to ``max_bytes`` in all."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for p in sorted(root.glob("*.py")):
        text = p.read_text(encoding="utf-8", errors="replace")
        out.append((p.name, text))
        total += len(text)
        if total >= max_bytes:
            break
    return out


def write_jsonl(path: Path, docs: list[tuple[str, str]]) -> Path:
    """One line per document: {"name": ..., "text": ...}."""
    with open(path, "w", encoding="utf-8") as f:
        for name, text in docs:
            f.write(json.dumps({"name": name, "text": text}) + "\n")
    return path


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """About 600 kB of Python sources as JSONL; documents are split into ~40-line pieces."""
    docs = []
    for name, text in stdlib_sources(600_000):
        lines = text.split("\n")
        for i in range(0, len(lines), 40):
            docs.append((f"{name}:{i}", "\n".join(lines[i:i + 40])))
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "stdlib.jsonl", docs)


@pytest.fixture(scope="session")
def sp_model(corpus, tmp_path_factory) -> str:
    """A SentencePiece BPE model (vocab 1000) trained on ``corpus``."""
    out = tmp_path_factory.mktemp("tok") / "sp"
    return train_sentencepiece([corpus], out, vocab_size=1000, input_sentence_size=20_000, num_threads=2)
