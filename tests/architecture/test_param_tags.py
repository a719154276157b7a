"""Parameter tags are read without a default (tests/architecture/rules.py, ``param_tag_reads``)."""

from __future__ import annotations

import ast

import pytest

from tests.architecture.rules import PARAM_TAGS, param_tag_reads


def test_the_packages_read_parameter_tags_without_a_default(sources):
    found = [str(o) for path, tree in sources for o in param_tag_reads(path, tree)]
    if found:
        pytest.fail("parameter tags read with a default:\n" + "\n".join(found), pytrace=False)


@pytest.mark.parametrize("tag", sorted(PARAM_TAGS))
def test_check_finds_a_tag_read_with_a_default(tag):
    source = f"def f(p):\n    return getattr(p, {tag!r}, False)\n"
    assert [(o.line, o.key) for o in param_tag_reads("m.py", ast.parse(source))] == [(2, f"getattr {tag}")]


@pytest.mark.parametrize("source", [
    "def f(p):\n    return p.tensor_parallel\n",
    "def f(p):\n    return getattr(p, 'tensor_parallel')\n",  # no default: an untagged parameter raises
    "def f(m):\n    return getattr(m, 'weight', None)\n",  # not a parameter tag
    "def f(p, name):\n    return getattr(p, name, None)\n",
])
def test_check_passes_other_reads(source):
    assert param_tag_reads("m.py", ast.parse(source)) == []
