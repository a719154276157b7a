"""The built-in sentence splitter."""

from __future__ import annotations

import pytest

from mg_data.sentences import get_splitter, split_simple


def test_split_simple_cases():
    assert split_simple("One. Two! Three? four") == ["One.", "Two!", "Three? four"]
    assert split_simple("Dr. Who met Mr. Smith. They left.") == ["Dr. Who met Mr. Smith.", "They left."]
    assert split_simple('He said "Stop." Then 3 cats ran.') == ['He said "Stop."', "Then 3 cats ran."]
    assert split_simple("Version 3.11 is out. e.g. this") == ["Version 3.11 is out. e.g. this"]
    assert split_simple("J. R. R. Tolkien wrote. Yes.") == ["J. R. R. Tolkien wrote.", "Yes."]
    assert split_simple("para one\n\npara two") == ["para one", "para two"]
    assert split_simple("   ") == []


def test_get_splitter():
    assert get_splitter("simple") is split_simple
    with pytest.raises(ValueError, match="sentence_splitter"):
        get_splitter("spacy")
