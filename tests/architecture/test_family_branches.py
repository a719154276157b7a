"""mg-cli holds no branch on a model family: it asks the family objects (``mg_models.family``) instead.

Read from the source, as the other rules: the family names are the ``mg_models.families`` entry points mg-models
declares, the family classes those defined in each family's folder (``mg_models/<family>/``). In
``packages/mg-cli/src`` a comparison with a family name (``==``, ``!=``, ``in`` a literal holding one), a literal
mapping keyed by one, a ``Literal`` type listing one, an ``isinstance`` against a family's class and an import from
a family's folder are offences.
"""

from __future__ import annotations

import ast

import pytest
import tomllib

from tests.architecture.rules import ROOT, Offence, parse, source_files

MODELS = ROOT / "packages" / "mg-models"


def family_names() -> frozenset[str]:
    """The families mg-models declares (its ``mg_models.families`` entry points)."""
    project = tomllib.loads((MODELS / "pyproject.toml").read_text())["project"]
    return frozenset(project["entry-points"]["mg_models.families"])


def family_classes() -> frozenset[str]:
    """Every class defined in a family's folder (its config, model and family classes)."""
    names = set()
    for name in family_names():
        for path in (MODELS / "src" / "mg_models" / name).glob("*.py"):
            names |= {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)}
    return frozenset(names)


def _strings(node: ast.AST) -> list[str]:
    """The string constants of ``node`` itself or of a tuple/list/set literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def family_branches(path: str, tree: ast.Module, names: frozenset[str], classes: frozenset[str]) -> list[Offence]:
    """Where ``tree`` branches on a family (see the module docstring)."""
    out = []

    def offence(node: ast.AST, key: str, why: str) -> None:
        out.append(Offence(path, node.lineno, key, why))

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            hit = sorted({s for side in (node.left, *node.comparators) for s in _strings(side)} & names)
            if hit:
                offence(node, f"compare {hit[0]}", f"compares with the family name {hit[0]!r}; ask the family object")
        elif isinstance(node, ast.Dict):
            hit = sorted({s for k in node.keys if k is not None for s in _strings(k)} & names)
            if hit:
                offence(node, f"mapping {hit[0]}", f"a mapping keyed by the family name {hit[0]!r}")
        elif isinstance(node, ast.Subscript) and isinstance(node.value, (ast.Name, ast.Attribute)) and (
                getattr(node.value, "id", None) == "Literal" or getattr(node.value, "attr", None) == "Literal"):
            hit = sorted(set(_strings(node.slice)) & names)
            if hit:
                offence(node, f"literal {hit[0]}", f"a Literal type listing the family name {hit[0]!r}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
              and len(node.args) == 2):
            hit = sorted({n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} & classes)
            if hit:
                offence(node, f"isinstance {hit[0]}", f"isinstance against the family class {hit[0]}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if parts[0] == "mg_models" and len(parts) > 1 and parts[1] in names:
                offence(node, f"import {node.module}", f"imports the family folder {node.module}")
            if node.module == "mg_models":
                hit = sorted({a.name for a in node.names} & classes)
                if hit:
                    offence(node, f"import {hit[0]}", f"imports the family class {hit[0]}")
    return out


def test_the_names_and_classes_are_found():
    assert {"gpt", "bert", "t5"} <= family_names()
    assert {"GPTFamily", "BertConfig", "BertModel", "T5Config", "T5Model"} <= family_classes()


def test_mg_cli_holds_no_branch_on_a_family():
    names, classes = family_names(), family_classes()
    found = [str(o) for p in source_files() if "packages/mg-cli/src/" in p.as_posix()
             for o in family_branches(*parse(p), names, classes)]
    if found:
        pytest.fail("family branches in mg-cli:\n" + "\n".join(found), pytrace=False)


@pytest.mark.parametrize("source, key", [
    ("if config.model.type == 't5':\n    pass\n", "compare t5"),
    ("x = family in ('bert', 't5')\n", "compare bert"),
    ("x = 'gpt' != family\n", "compare gpt"),
    ("STEPS = {'gpt': 1, 'bert': 2}\n", "mapping bert"),
    ("from typing import Literal\nT = Literal['gpt', 'bert']\n", "literal bert"),
    ("ok = isinstance(config, T5Config)\n", "isinstance T5Config"),
    ("ok = isinstance(config, (BertConfig, int))\n", "isinstance BertConfig"),
    ("from mg_models.t5 import T5Model\n", "import mg_models.t5"),
    ("from mg_models import BertModel\n", "import BertModel"),
])
def test_check_finds_a_branch(source, key):
    found = family_branches("m.py", ast.parse(source), frozenset({"gpt", "bert", "t5"}),
                            frozenset({"T5Config", "BertConfig", "BertModel", "T5Model"}))
    assert [o.key for o in found] == [key]


@pytest.mark.parametrize("source", [
    "if fam.kind == 'encoder-decoder':\n    pass\n",
    "x = extra.get('model_family', 'gpt')\n",  # a default value, not a branch
    "from mg_models.family import get_family\n",
    "ok = isinstance(config, dict)\n",
])
def test_check_passes_family_free_code(source):
    assert family_branches("m.py", ast.parse(source), frozenset({"gpt", "bert", "t5"}),
                           frozenset({"T5Config"})) == []
