"""Architecture rules read from the source of every package (``packages/*/src``), never by importing it.

Each check takes one parsed module and returns its :class:`Offence` list (``path:line: what is wrong``):

- :func:`module_state` finds module-level mutable state: ``global`` statements; module-level names
  bound to a mutable container (a list, dict or set literal or comprehension, ``dict()``,
  ``defaultdict()``, ``deque()``, ...) that the module mutates anywhere (a mutating method call,
  item assignment or deletion, ``+=``), or that are not named as constants (UPPER_CASE); names bound
  to objects that exist only to change (``threading.local()``, ``itertools.count()``, a queue); and
  process state changed at import (``atexit.register``, ``signal.signal``,
  ``sys.setrecursionlimit``, ... called or used as a decorator at module or class level, or an
  attribute or item of an imported module assigned there). A container built in one expression
  and only read afterwards (a constant table) is fine.
- :func:`param_tag_reads` finds ``getattr(obj, "<tag>", default)`` for the tags mg-parallel sets on
  parameters (:data:`PARAM_TAGS`): a default hides a missing tag, so a parameter the layers never
  tagged reads as "not sharded" instead of failing.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Attributes mg-parallel (and the models, through its helpers) set on parameters.
PARAM_TAGS = frozenset({
    "tensor_parallel", "partition_dim", "sequence_parallel", "expert_parallel", "num_experts", "ep_rank",
    "shared_embedding", "pipeline_replicated", "main_grad",
})

# Calls that make a new mutable container (fully qualified names, import aliases resolved).
MUTABLE_FACTORIES = frozenset({
    "list", "dict", "set", "bytearray",
    "collections.defaultdict", "collections.OrderedDict", "collections.Counter", "collections.deque",
    "collections.ChainMap", "weakref.WeakValueDictionary", "weakref.WeakKeyDictionary", "weakref.WeakSet",
})
# Calls whose result exists only to change: bound at module level, it is state whatever the module does.
STATEFUL_FACTORIES = frozenset({"threading.local", "itertools.count", "queue.Queue", "queue.SimpleQueue"})

MUTATING_METHODS = frozenset({
    "append", "extend", "insert", "remove", "pop", "popitem", "clear", "update", "setdefault", "add",
    "discard", "sort", "reverse", "appendleft", "extendleft", "popleft", "rotate", "difference_update",
    "intersection_update", "symmetric_difference_update", "__setitem__", "__delitem__",
})

# Calls that change the state of the whole process.
PROCESS_STATE_CALLS = frozenset({
    "atexit.register", "signal.signal", "signal.setitimer", "signal.alarm", "signal.siginterrupt",
    "sys.setrecursionlimit", "sys.settrace", "sys.setprofile", "sys.setswitchinterval",
    "sys.set_int_max_str_digits", "sys.path.append", "sys.path.insert", "sys.path.extend",
    "threading.settrace", "threading.setprofile", "faulthandler.enable", "faulthandler.register",
    "faulthandler.dump_traceback_later", "warnings.filterwarnings", "warnings.simplefilter",
    "logging.basicConfig", "logging.captureWarnings", "logging.disable", "logging.setLoggerClass",
    "os.putenv", "os.unsetenv", "os.environ.setdefault", "os.environ.update", "os.environ.pop",
    "os.chdir", "os.umask", "gc.disable", "gc.set_threshold", "gc.freeze", "resource.setrlimit",
    "locale.setlocale", "socket.setdefaulttimeout", "random.seed", "copyreg.pickle", "codecs.register",
    "multiprocessing.set_start_method", "numpy.random.seed", "numpy.seterr",
    "torch.manual_seed", "torch.set_default_dtype", "torch.set_default_device", "torch.set_num_threads",
    "torch.set_num_interop_threads", "torch.set_grad_enabled", "torch.set_float32_matmul_precision",
    "torch.use_deterministic_algorithms", "torch.multiprocessing.set_start_method",
})


@dataclass(frozen=True)
class Offence:
    """One broken rule: where, a line-independent ``key`` (what a list of known offences names) and why."""

    path: str
    line: int
    key: str
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.why}"


def source_files(root: Path = ROOT) -> list[Path]:
    """Every module of every package: ``packages/*/src/**/*.py`` under ``root``, sorted."""
    return sorted(root.glob("packages/*/src/**/*.py"))


def parse(path: Path, root: Path = ROOT) -> tuple[str, ast.Module]:
    """``path`` relative to ``root`` (as offences name it) and its syntax tree."""
    return path.relative_to(root).as_posix(), ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


# --- helpers ---------------------------------------------------------------------------------------------------


def _module_level(body: Iterable[ast.stmt], *, into_classes: bool) -> Iterator[ast.stmt]:
    """The statements that run at import: the module's, those inside its top-level ``if``/``try``/``with``/
    loops, and (with ``into_classes``) those of class bodies; never a function's."""
    for node in body:
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or (
                isinstance(node, ast.ClassDef) and not into_classes):
            continue
        for field in ("body", "orelse", "finalbody"):
            yield from _module_level(getattr(node, field, None) or [], into_classes=into_classes)
        for handler in getattr(node, "handlers", None) or []:
            yield from _module_level(handler.body, into_classes=into_classes)
        for case in getattr(node, "cases", None) or []:
            yield from _module_level(case.body, into_classes=into_classes)


def _import_aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> fully qualified name, for the module's top-level imports (``np`` -> ``numpy``)."""
    aliases: dict[str, str] = {}
    for node in _module_level(tree.body, into_classes=False):
        if isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]
                aliases[a.asname or top] = a.name if a.asname else top
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases


def _qualified(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """The fully qualified name of a name or attribute chain (``np.random.seed`` -> ``numpy.random.seed``)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([aliases.get(node.id, node.id), *reversed(parts)])


def _is_mutable(value: ast.AST, aliases: dict[str, str]) -> bool:
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    return isinstance(value, ast.Call) and _qualified(value.func, aliases) in MUTABLE_FACTORIES


def _bindings(target: ast.AST, value: ast.AST | None) -> Iterator[tuple[ast.Name, ast.AST | None]]:
    """(name, value) pairs of one assignment target, through unpacking of a tuple or list display."""
    if isinstance(target, ast.Name):
        yield target, value
    elif isinstance(target, (ast.Tuple, ast.List)):
        same = isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts)
        for i, t in enumerate(target.elts):
            yield from _bindings(t, value.elts[i] if same else None)  # type: ignore[union-attr]


def _module_bindings(tree: ast.Module) -> Iterator[tuple[ast.stmt, ast.Name, ast.AST | None]]:
    """(statement, name, value) of every module-level assignment."""
    for node in _module_level(tree.body, into_classes=False):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                for name, value in _bindings(t, node.value):
                    yield node, name, value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            for name, value in _bindings(node.target, node.value):
                yield node, name, value


def _root_name(node: ast.AST) -> ast.Name | None:
    """The name under a chain of subscripts (``x`` of ``x[a][b]``)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return node if isinstance(node, ast.Name) else None


def _function_locals(fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> tuple[set[str], set[str]]:
    """Names a function binds itself (nested scopes excluded), and names it declares ``global``."""
    args = fn.args
    bound = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg] if a}
    declared_global: set[str] = set()
    stack: list[ast.AST] = list(fn.body) if isinstance(fn.body, list) else [fn.body]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
            continue  # its own scope
        if isinstance(node, ast.Global):
            declared_global.update(node.names)
        elif isinstance(node, ast.Nonlocal):
            bound.update(node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        if not isinstance(node, ast.Lambda):
            stack.extend(ast.iter_child_nodes(node))
    return bound - declared_global, declared_global


def _mutations(tree: ast.Module, names: set[str]) -> Iterator[tuple[str, int, str]]:
    """(name, line, how) for every mutation of one of the module-level ``names``. Scope-aware: a function's or a
    comprehension's own variable of the same name is not the module's."""

    def module_name(target: ast.AST, shadowed: frozenset[str]) -> str | None:
        n = _root_name(target)
        return n.id if n is not None and n.id in names and n.id not in shadowed else None

    def visit(node: ast.AST, shadowed: frozenset[str]) -> Iterator[tuple[str, int, str]]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for d in getattr(node, "decorator_list", []):
                yield from visit(d, shadowed)
            bound, declared_global = _function_locals(node)
            inner = frozenset((shadowed | bound) - declared_global)
            for child in node.body if isinstance(node.body, list) else [node.body]:
                yield from visit(child, inner)
            return
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            shadowed = shadowed | {n.id for g in node.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)}
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATING_METHODS:
            if name := module_name(node.func.value, shadowed):
                yield name, node.lineno, f".{node.func.attr}()"
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            for t in node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]:
                if isinstance(t, ast.Subscript) and (name := module_name(t, shadowed)):
                    yield name, node.lineno, "del x[...]" if isinstance(node, ast.Delete) else "x[...] ="
                elif isinstance(node, ast.AugAssign) and isinstance(t, ast.Name) and module_name(t, shadowed):
                    yield t.id, node.lineno, "augmented assignment, in place"
        for child in ast.iter_child_nodes(node):
            yield from visit(child, shadowed)

    for stmt in tree.body:
        yield from visit(stmt, frozenset())


def _import_time_exprs(stmt: ast.stmt) -> tuple[list[ast.expr], list[ast.expr]]:
    """(decorators, other expressions) of one statement evaluated when the module or class body runs, without
    the statements nested in it (``_module_level`` yields those) and without function bodies."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return stmt.decorator_list, [*stmt.args.defaults, *(d for d in stmt.args.kw_defaults if d is not None)]
    if isinstance(stmt, ast.ClassDef):
        return stmt.decorator_list, [*stmt.bases, *(k.value for k in stmt.keywords)]
    if isinstance(stmt, (ast.If, ast.While)):
        return [], [stmt.test]
    if isinstance(stmt, (ast.For, ast.AsyncFor)):
        return [], [stmt.iter]
    if isinstance(stmt, (ast.With, ast.AsyncWith)):
        return [], [item.context_expr for item in stmt.items]
    if isinstance(stmt, ast.Match):
        return [], [stmt.subject]
    if isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
        return [], []
    return [], [stmt]  # type: ignore[list-item]


def _calls(node: ast.AST) -> Iterator[ast.Call]:
    """Calls under ``node`` that run when it is evaluated (none inside a lambda's body)."""
    if isinstance(node, ast.Call):
        yield node
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, ast.Lambda):
            yield from _calls(child)


# --- checks ----------------------------------------------------------------------------------------------------


def _global_statements(path: str, nodes: list[ast.AST]) -> Iterator[Offence]:
    for node in nodes:
        if isinstance(node, ast.Global):
            for name in node.names:
                yield Offence(path, node.lineno, f"global {name}",
                              f"`global {name}` rebinds module state; keep it in an object that is passed or owned")


def _may_mutate(nodes: list[ast.AST], names: set[str]) -> bool:
    """Whether any node has the shape of a mutation of one of ``names`` (a cheap filter before the scope-aware
    walk of :func:`_mutations`)."""
    for node in nodes:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value
        elif isinstance(node, (ast.Assign, ast.Delete)):
            target = next((t for t in node.targets if isinstance(t, ast.Subscript)), None)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            target = node.target
        else:
            continue
        root = _root_name(target) if target is not None else None
        if root is not None and root.id in names:
            return True
    return False


def _module_containers(path: str, tree: ast.Module, nodes: list[ast.AST], aliases: dict[str, str]
                       ) -> Iterator[Offence]:
    containers: dict[str, int] = {}
    for stmt, name, value in _module_bindings(tree):
        factory = _qualified(value.func, aliases) if isinstance(value, ast.Call) else None
        if factory in STATEFUL_FACTORIES:
            yield Offence(path, stmt.lineno, f"state {name.id}", f"`{name.id}` is module-level state ({factory}())")
        elif value is not None and _is_mutable(value, aliases):
            containers.setdefault(name.id, stmt.lineno)
            if not (name.id.startswith("__") or name.id.lstrip("_").isupper()):
                yield Offence(path, stmt.lineno, f"lowercase {name.id}",
                              f"module-level container `{name.id}` is named like a variable; a constant table is "
                              "UPPER_CASE (and never mutated)")
    if not _may_mutate(nodes, set(containers)):
        return
    for name, line, how in _mutations(tree, set(containers)):
        yield Offence(path, line, f"mutated {name}",
                      f"module-level `{name}` (bound at line {containers[name]}) is mutated ({how}); build it in one "
                      "expression, or keep it in an object")


def _import_time_side_effects(path: str, tree: ast.Module, aliases: dict[str, str]) -> Iterator[Offence]:
    for stmt in _module_level(tree.body, into_classes=True):
        decorators, exprs = _import_time_exprs(stmt)
        funcs = [d.func if isinstance(d, ast.Call) else d for d in decorators]  # `@atexit.register` calls it too
        funcs += [call.func for e in exprs for call in _calls(e)]
        for func in funcs:
            if (qualified := _qualified(func, aliases)) in PROCESS_STATE_CALLS:
                yield Offence(path, func.lineno, qualified,
                              f"`{qualified}` at import changes process state; do it when the object that needs it "
                              "is first used")
        if isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            for t in stmt.targets if isinstance(stmt, (ast.Assign, ast.Delete)) else [stmt.target]:
                root = t
                while isinstance(root, (ast.Attribute, ast.Subscript)):
                    root = root.value
                if root is not t and isinstance(root, ast.Name) and root.id in aliases:
                    target = ast.unparse(t)
                    yield Offence(path, stmt.lineno, f"assigns {target}",
                                  f"module-level assignment to `{target}` changes another module's state at import")


def module_state(path: str, tree: ast.Module) -> list[Offence]:
    """Offences against "no module-level mutable state" in one module (see the module docstring)."""
    aliases = _import_aliases(tree)
    nodes = list(ast.walk(tree))
    return [*_global_statements(path, nodes), *_module_containers(path, tree, nodes, aliases),
            *_import_time_side_effects(path, tree, aliases)]


def param_tag_reads(path: str, tree: ast.Module) -> list[Offence]:
    """``getattr(obj, "<tag>", default)`` reads of parameter tags (:data:`PARAM_TAGS`) in one module."""
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and len(node.args) == 3 and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in PARAM_TAGS):
            tag = node.args[1].value
            out.append(Offence(path, node.lineno, f"getattr {tag}",
                               f"getattr(..., {tag!r}, default): a default hides a parameter that was never tagged; "
                               "read the tag where mg-parallel defines it, without a default"))
    return sorted(out, key=lambda o: o.line)
