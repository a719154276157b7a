"""Build the data of the fine-tuning examples from this machine's Python standard library (no download).

Every output is deterministic for a given Python installation: files and functions are read in
sorted order and every random choice comes from a seeded ``random.Random``. Held-out examples are
chosen by a hash of their name, so they stay out of every training file, the pretraining corpus
included.

    python examples/finetune/make_data.py corpus    OUT   # stdlib sources for pretraining and tokenizers
    python examples/finetune/make_data.py sft       OUT   # chat conversations (train / valid / prompts)
    python examples/finetune/make_data.py classify  OUT   # code snippet -> standard-library package
    python examples/finetune/make_data.py translate OUT   # Python 2-style line -> Python 3 line
    python examples/finetune/make_data.py codegen   OUT   # docstring -> function; HumanEval-format problems
    python examples/finetune/make_data.py all       OUT

Each subcommand prints what it wrote and a few counts.
"""

from __future__ import annotations

import argparse
import ast
import collections
import doctest
import hashlib
import json
import random
import re
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SEED = 1234


# ------------------------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Function:
    """A top-level function of a standard-library module, with its source text."""

    module: str        # dotted module name, e.g. "email.utils"
    name: str
    source: str        # the function's lines as written (decorators excluded)
    header: str        # from "def" through the end of the docstring ("" without a docstring)
    docstring: str     # cleaned (inspect.cleandoc style); "" when there is none
    params: tuple[str, ...]
    used_names: frozenset[str]

    @property
    def key(self) -> str:
        return f"{self.module}.{self.name}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(STDLIB).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def stdlib_files() -> Iterator[Path]:
    """The standard library's own ``.py`` files in sorted order, without tests, demos and site-packages."""
    skip = {"test", "tests", "idle_test", "site-packages", "lib2to3", "__phello__", "Tools", "turtledemo"}
    for path in sorted(STDLIB.rglob("*.py")):
        rel = path.relative_to(STDLIB).parts
        if skip.intersection(rel) or any(p.startswith("test_") for p in rel):
            continue
        yield path


def read_source(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def functions(path: Path, text: str) -> list[Function]:
    """Top-level ``def`` statements of one file (not async, not nested)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.end_lineno is None:
            continue
        source = "".join(lines[node.lineno - 1:node.end_lineno])
        doc = ast.get_docstring(node) or ""
        header = ""
        first = node.body[0]
        if doc and isinstance(first, ast.Expr) and first.end_lineno is not None:
            header = "".join(lines[node.lineno - 1:first.end_lineno])
        a = node.args
        params = tuple(p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs])
        used = frozenset(n.id for n in ast.walk(node) if isinstance(n, ast.Name))
        out.append(Function(_module_name(path), node.name, source, header, doc, params, used))
    return out


def all_functions() -> list[Function]:
    out = []
    for path in stdlib_files():
        text = read_source(path)
        if text is not None:
            out.extend(functions(path, text))
    return out


def held_out(name: str, share: float) -> bool:
    """A fixed pseudo-random share of names, the same on every run and machine (no Python hash seed)."""
    h = int.from_bytes(hashlib.sha256(f"{SEED}:{name}".encode()).digest()[:8], "big")
    return h / 2**64 < share


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"  {path}: {len(rows)} lines")


# ------------------------------------------------------------------------------------------ codegen
# Defined first: its held-out problems are cut out of the pretraining corpus too.

CODEGEN_HELD_OUT = 0.5
"""Share of the functions with runnable doctest examples that become evaluation problems."""
SEEN_REPEATS = 24
"""How often each seen problem's function is in the code-generation training documents."""


def _imports(tree: ast.Module) -> dict[str, str]:
    """name -> the top-level import statement that binds it (absolute imports only)."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for a in node.names:
                out[(a.asname or a.name).split(".")[0]] = ast.unparse(ast.Import(names=[a]))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
            for a in node.names:
                if a.name != "*":
                    out[a.asname or a.name] = ast.unparse(ast.ImportFrom(module=node.module, names=[a], level=0))
    return out


def _doctest_checks(fn: Function) -> list[str]:
    """``assert`` lines from the docstring's ``>>>`` examples that call the function and show a value."""
    checks = []
    for ex in doctest.DocTestParser().get_examples(fn.docstring):
        src, want = ex.source.strip(), ex.want.strip()
        if not want or "\n" in src or "Traceback" in want or f"{fn.name}(" not in src:
            continue
        try:
            ast.parse(src, mode="eval")
        except SyntaxError:
            continue
        checks.append(f"    assert repr({src}) == {want!r}")
    return checks


def _passes(program: str, timeout_s: float = 10.0) -> bool:
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "p.py").write_text(program)
        try:
            r = subprocess.run([sys.executable, "-I", "p.py"], cwd=d, capture_output=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
    return r.returncode == 0


def codegen_problems() -> tuple[list[dict], list[dict]]:
    """HumanEval-format problems from stdlib functions whose doctest examples pass when the function is cut
    out of its module (with the imports it uses): ``(held_out, seen_in_training)``."""
    held, seen = [], []
    for path in stdlib_files():
        text = read_source(path)
        if text is None:
            continue
        try:
            imports = _imports(ast.parse(text))
        except SyntaxError:
            continue
        for fn in functions(path, text):
            if not fn.header or len(fn.source) > 1500:
                continue
            checks = _doctest_checks(fn)
            if not checks:
                continue
            needed = [imports[n] for n in sorted(fn.used_names) if n in imports]
            prompt = "".join(line + "\n" for line in needed) + ("\n\n" if needed else "") + fn.header
            test = "def check(candidate):\n" + f"    {fn.name} = candidate\n" + "\n".join(checks) + "\n"
            canonical = fn.source[len(fn.header):]
            if not _passes(prompt + canonical + "\n\n" + test + f"\n\ncheck({fn.name})\n"):
                continue
            row = {"task_id": fn.key, "prompt": prompt, "canonical_solution": canonical, "test": test,
                   "entry_point": fn.name}
            (held if held_out(fn.key, CODEGEN_HELD_OUT) else seen).append(row)
    return held, seen


def _held_out_codegen_keys(out: Path) -> set[str]:
    """The held-out problems' names, from ``OUT/codegen/problems.jsonl`` (written first when missing)."""
    problems = out / "codegen" / "problems.jsonl"
    if not problems.exists():
        make_codegen(out)
    return {json.loads(line)["task_id"] for line in problems.read_text().splitlines()}


def make_codegen(out: Path) -> None:
    """Training documents (every documented top-level function but the held-out problems) and problems."""
    held, seen = codegen_problems()
    keys = {p["task_id"] for p in held}
    docs = [{"text": fn.source} for fn in all_functions()
            if fn.header and fn.key not in keys and len(fn.source) <= 3000]
    # The seen problems' functions again, SEEN_REPEATS more times, so that a model this small can learn them by
    # heart: their pass@k checks the whole path (prompt, generation with its indentation, execution, test).
    # (as the problem shows them: the imports the function uses, then the function)
    docs += [{"text": p["prompt"] + p["canonical_solution"]} for p in seen] * SEEN_REPEATS
    random.Random(SEED).shuffle(docs)
    write_jsonl(out / "codegen" / "train.jsonl", docs)
    write_jsonl(out / "codegen" / "problems.jsonl", held)
    write_jsonl(out / "codegen" / "seen_problems.jsonl", seen)
    print(f"  {len(held)} held-out problems (never in training data or corpus), {len(seen)} seen in training")


# -------------------------------------------------------------------------------------------- corpus


def make_corpus(out: Path, max_bytes: int = 4_000_000) -> None:
    """Standard-library sources, one JSON line per file, with the held-out codegen functions cut out."""
    keys = _held_out_codegen_keys(out)
    rows, total, cut = [], 0, 0
    for path in stdlib_files():
        text = read_source(path)
        if not text or not text.strip():
            continue
        for fn in functions(path, text):
            if fn.key in keys:
                text = text.replace(fn.source, "")
                cut += 1
        rows.append({"text": text})
        total += len(text.encode())
        if total >= max_bytes:
            break
    write_jsonl(out / "corpus.jsonl", rows)
    print(f"  {total / 1e6:.1f} MB of source; {cut} held-out codegen functions cut out")


# ----------------------------------------------------------------------------------------------- sft

SYSTEM = "You answer questions about the Python standard library."


def _first_line(doc: str) -> str:
    line = doc.strip().split("\n\n")[0].replace("\n", " ")
    return re.sub(r"\s+", " ", line).strip()


def make_sft(out: Path) -> None:
    """Conversations in three templates over public, documented stdlib functions:

    * "What does m.f do?" -> the first paragraph of its docstring (recall);
    * "What are the parameters of m.f?" -> "a, b, c" / "It takes no parameters." (recall);
    * "Write the name m.f in upper case." -> "M.F" (a rule the model can apply to unseen names).

    Held-out: 5% of the functions (all their questions), in valid.jsonl and prompts.txt.
    """
    rng = random.Random(SEED)
    train, valid = [], []
    for fn in all_functions():
        if fn.name.startswith("_") or not fn.docstring or fn.module.startswith(("_", "encodings")):
            continue
        doc = _first_line(fn.docstring)
        if not 10 <= len(doc) <= 160:
            continue
        params = [p for p in fn.params if p not in ("self", "cls")]
        turns = [
            (f"What does {fn.key} do?", doc),
            (f"What are the parameters of {fn.key}?",
             ", ".join(params) if params else "It takes no parameters."),
            (f"Write the name {fn.key} in upper case.", fn.key.upper()),
        ]
        for q, a in turns:
            messages = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            if rng.random() < 0.5:
                messages.insert(0, {"role": "system", "content": SYSTEM})
            (valid if held_out(fn.key, 0.05) else train).append({"messages": messages})
    rng.shuffle(train)
    write_jsonl(out / "sft" / "train.jsonl", train)
    write_jsonl(out / "sft" / "valid.jsonl", valid)
    prompts = [chatml_prompt(c["messages"][:-1]) for c in valid[:6]]
    (out / "sft" / "prompts.json").write_text(json.dumps(prompts, indent=1) + "\n")
    print(f"  {out / 'sft' / 'prompts.json'}: {len(prompts)} held-out prompts in ChatML, ending with the "
          f"assistant header")


def chatml_prompt(messages: list[dict]) -> str:
    """The ChatML text the model is trained on, up to and including the assistant's header."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + "<|im_start|>assistant\n"


# ------------------------------------------------------------------------------------------ classify

PACKAGES = ("asyncio", "email", "tkinter", "unittest", "xml", "multiprocessing", "concurrent", "http")
"""The classes: the standard-library package a function comes from."""


def make_classify(out: Path, per_class: int = 240, lines: int = 8) -> None:
    """Snippets (a function or method's first ``lines`` lines, dedented, docstring kept) labelled with their
    top-level package; at most ``per_class`` per package, 20% of each held out as the test split."""
    by_label: dict[str, list[str]] = collections.defaultdict(list)
    for path in stdlib_files():
        mod = _module_name(path)
        top = mod.split(".")[0]
        if top not in PACKAGES:
            continue
        text = read_source(path)
        if text is None:
            continue
        src = text.splitlines()
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno:
                body = src[node.lineno - 1:min(node.end_lineno, node.lineno - 1 + lines)]
                snippet = textwrap.dedent("\n".join(body)).strip()
                if len(snippet) >= 40:
                    by_label[top].append(snippet)
    rng = random.Random(SEED)
    train, test = [], []
    for label in PACKAGES:
        items = sorted(set(by_label[label]))
        rng.shuffle(items)
        items = items[:per_class]
        n_test = len(items) // 5
        test += [{"text": t, "label": label} for t in items[:n_test]]
        train += [{"text": t, "label": label} for t in items[n_test:]]
    rng.shuffle(train)
    rng.shuffle(test)
    write_jsonl(out / "classify" / "train.jsonl", train)
    write_jsonl(out / "classify" / "test.jsonl", test)
    counts = collections.Counter(r["label"] for r in test)
    top, n = counts.most_common(1)[0]
    print(f"  classes: {', '.join(f'{k} {counts[k]}' for k in PACKAGES)} (test); majority-class baseline on "
          f"test: {n / len(test):.3f} ({top})")
    # mg eval's classification task takes integer labels: the ids mg train gives the names (sorted).
    ids = {name: i for i, name in enumerate(sorted(PACKAGES))}
    write_jsonl(out / "classify" / "test_ids.jsonl", [{"text": r["text"], "label": ids[r["label"]]} for r in test])


# ----------------------------------------------------------------------------------------- translate

_PRINT = re.compile(r"^(\s*)print\((.*)\)$")
_EXCEPT = re.compile(r"^(\s*)except (\w[\w.]*|\([\w., ]+\)) as (\w+):$")
_RAISE = re.compile(r"^(\s*)raise (\w[\w.]*)\(([^()]*)\)$")
_ITER = re.compile(r"\.(items|keys|values)\(\)")


def to_py2(line: str) -> str | None:
    """The Python 2 spelling of a Python 3 line, or None when no rule applies (or the line is unsuitable).

    Rules: ``print(x)`` -> ``print x``; ``except E as e:`` -> ``except E, e:``; ``raise E(msg)`` ->
    ``raise E, msg``; ``d.items()`` -> ``d.iteritems()`` (keys, values alike); ``range(`` -> ``xrange(``;
    ``!=`` -> ``<>``.
    """
    s = line.rstrip()
    old = s
    m = _PRINT.match(s)
    if m:
        args = m.group(2)
        if "=" in re.sub(r"(==|!=|<=|>=)", "", args) or "*" in args:
            return None  # keyword arguments (file=, end=) or unpacking have no one-to-one print statement
        try:
            call = ast.parse(s.strip()).body[0].value  # type: ignore[attr-defined]
        except (SyntaxError, AttributeError):
            return None
        if not isinstance(call, ast.Call) or len(call.args) == 0:
            return None
        s = f"{m.group(1)}print {args}"
    m = _EXCEPT.match(s)
    if m:
        s = f"{m.group(1)}except {m.group(2)}, {m.group(3)}:"
    m = _RAISE.match(s)
    if m and m.group(3) and "," not in m.group(3):
        s = f"{m.group(1)}raise {m.group(2)}, {m.group(3)}"
    s = _ITER.sub(lambda k: f".iter{k.group(1)}()", s)
    s = re.sub(r"(?<![\w.])range\(", "xrange(", s)
    s = s.replace(" != ", " <> ")
    return None if s == old else s


def make_translate(out: Path, max_chars: int = 64) -> None:
    """Pairs {input: Python 2-style line, target: the stdlib's Python 3 line}, stripped, one line each,
    deduplicated; 10% of the distinct targets held out as the test split."""
    pairs = {}
    for path in stdlib_files():
        text = read_source(path)
        if text is None:
            continue
        for line in text.splitlines():
            if len(line.strip()) > max_chars or "#" in line or '"""' in line:
                continue
            py2 = to_py2(line)
            if py2 is not None:
                pairs.setdefault(line.strip(), py2.strip())
    train, test = [], []
    for target in sorted(pairs):
        (test if held_out(target, 0.1) else train).append({"input": pairs[target], "target": target})
    random.Random(SEED).shuffle(train)
    write_jsonl(out / "translate" / "train.jsonl", train)
    write_jsonl(out / "translate" / "test.jsonl", test)
    rules = collections.Counter(rule for r in test for rule in _rules_applied(r["input"], r["target"]))
    print(f"  test lines per rule: {dict(sorted(rules.items()))}")
    try:
        import sacrebleu
    except ImportError:
        return
    hyps, refs = [r["input"] for r in test], [[r["target"] for r in test]]
    print(f"  baseline, the input copied unchanged: exact match 0, BLEU {sacrebleu.corpus_bleu(hyps, refs).score:.1f}, "
          f"chrF {sacrebleu.corpus_chrf(hyps, refs).score:.1f}")


def _rules_applied(py2: str, py3: str) -> list[str]:
    rules = {"print": py2.startswith("print ") and py3.startswith("print("), "except": "except " in py2 and
             " as " in py3 and " as " not in py2, "raise": py2.startswith("raise ") and "," in py2,
             "iter": ".iter" in py2 and ".iter" not in py3, "xrange": "xrange(" in py2, "<>": "<>" in py2}
    return [k for k, v in rules.items() if v]


# ---------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["corpus", "sft", "classify", "translate", "codegen", "all"])
    parser.add_argument("out", type=Path, help="output folder (e.g. ft)")
    args = parser.parse_args()
    steps = {"codegen": make_codegen, "corpus": make_corpus, "sft": make_sft, "classify": make_classify,
             "translate": make_translate}
    for name, step in steps.items():
        if args.what in (name, "all"):
            print(f"{name}:")
            step(args.out)


if __name__ == "__main__":
    main()
