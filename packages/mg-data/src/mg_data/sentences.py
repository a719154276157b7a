"""Dependency-light sentence splitting for ``--split-sentences`` (NLTK punkt optional)."""

from __future__ import annotations

import re
from collections.abc import Callable

# A sentence ends at ., ! or ? (optionally followed by closing quotes/brackets) when whitespace
# and then an upper-case letter, digit or opening quote follow; common abbreviations do not end one.
_BOUNDARY = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st vs etc e.g i.e fig no vol al approx inc ltd co corp dept est".split())


def split_simple(text: str) -> list[str]:
    """Split ``text`` into sentences with a regular expression; whitespace between them is dropped.

    Paragraph breaks (blank lines) always end a sentence.
    """
    out: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        start = 0
        for m in _BOUNDARY.finditer(para):
            head = para[start:m.start()].rstrip("\"')]")
            last_word = head.rsplit(None, 1)[-1].rstrip(".!?").lower() if head.strip() else ""
            if last_word in _ABBREVIATIONS or (len(last_word) == 1 and last_word.isalpha()):
                continue
            piece = para[start:m.end()].strip()
            if piece:
                out.append(piece)
            start = m.end()
        tail = para[start:].strip()
        if tail:
            out.append(tail)
    return out


def get_splitter(name: str) -> Callable[[str], list[str]]:
    """The splitter called ``name``: ``simple`` (built in) or ``nltk`` (punkt; needs nltk and its data).

    Raises:
        ValueError: unknown name. ImportError: ``nltk`` requested but not installed.
    """
    if name == "simple":
        return split_simple
    if name == "nltk":
        try:
            import nltk
        except ImportError:
            raise ImportError("sentence_splitter='nltk' needs `pip install nltk` (and its punkt data)") from None
        return nltk.tokenize.sent_tokenize
    raise ValueError(f"sentence_splitter must be 'simple' or 'nltk', got {name!r}")
