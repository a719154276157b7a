"""lm-evaluation-harness tasks named by ``--harness-task``: task YAMLs checked before anything runs.

A YAML file is read by lm-eval's own loader, so ``include:``, ``!function`` and groups mean what they
mean to ``lm_eval``; its directory goes on the harness's include path (a group finds its member tasks
there). Before the harness builds a task, the file is checked: malformed YAML, a missing include, or
no ``task:``/``group:`` key is one line naming the file. Building a task runs the Python its YAMLs name
(``!function module.name`` imports ``module.py`` from the YAML's directory; a group builds its members,
an ``include:`` brings in another file's), so a task whose YAMLs, their includes or its group's members
name any Python is refused without ``allow_code_execution``, naming the file and the reference; so is a
task marked ``unsafe_code: true`` (it runs the programs the model writes). The harness's own task
folders are its installed code and need no opt-in.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["HarnessTaskError", "is_task_file", "prepare_tasks", "read_task_file"]


class HarnessTaskError(ValueError):
    """A ``--harness-task`` that cannot be loaded; the message is one line naming the file."""


def is_task_file(task: str) -> bool:
    """A ``--harness-task`` value is a YAML file (otherwise it is a task, group or tag name)."""
    return task.endswith((".yaml", ".yml"))


def _lm_eval_dir() -> Path:
    import lm_eval

    return Path(lm_eval.__file__).resolve().parent


def read_task_file(path: str | Path) -> dict[str, Any]:
    """The task config of a YAML file, includes merged, ``!function`` references left unresolved (nothing runs).

    Raises:
        HarnessTaskError: no such file, malformed YAML (where), a missing include, no ``task:``/``group:`` key.
    """
    import yaml
    from lm_eval.tasks._yaml_loader import load_yaml

    p = Path(path)
    if not p.is_file():
        raise HarnessTaskError(f"--harness-task {path}: no such file")
    try:
        cfg = load_yaml(p, resolve_func=False, recursive=True)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        in_file = mark.name if mark and mark.name and not mark.name.startswith("<") else str(path)
        raise HarnessTaskError(f"{in_file}: malformed YAML ({e.problem or e.context}{where})") from None
    except yaml.YAMLError as e:
        raise HarnessTaskError(f"{path}: malformed YAML ({str(e).splitlines()[0]})") from None
    except OSError as e:
        raise HarnessTaskError(f"{path}: {e.strerror or e}: {e.filename} (in an include:)") from None
    except (ValueError, RecursionError) as e:
        raise HarnessTaskError(f"{path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if "task" not in cfg and "group" not in cfg:
        raise HarnessTaskError(f"{path}: no task: key; a task YAML names its task (task: NAME), a group YAML "
                               f"its group (group: NAME) and lists its tasks under task:")
    if "group" not in cfg and not isinstance(cfg["task"], str):
        raise HarnessTaskError(f"{path}: task: must be the task's name (a list of tasks needs group: NAME)")
    return cfg


def _function_tags(node: Any) -> Iterator[str]:
    """The ``!function`` references in a composed YAML node tree, in document order."""
    import yaml

    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        if n.tag == "!function":
            yield str(n.value)
        if isinstance(n, yaml.SequenceNode):
            stack.extend(reversed(n.value))
        elif isinstance(n, yaml.MappingNode):
            stack.extend(reversed([x for kv in n.value for x in kv]))


class _CodeFinder:
    """Walks a task's YAML files (its includes, its group's members) for the first thing that runs Python."""

    def __init__(self, index: dict[str, Any]) -> None:
        self.index, self.seen, self.package = index, set(), _lm_eval_dir()

    def entry(self, name: str) -> tuple[str, str] | None:
        """``(file, what runs Python)`` in the index entry ``name`` (a task, group or tag), if anything."""
        e = self.index.get(name)
        if e is None:
            return None
        if e.yaml_path is not None:
            return self.file(Path(e.yaml_path))
        return next((found for member in sorted(getattr(e, "tags", ())) if (found := self.entry(member))), None)

    def file(self, path: Path) -> tuple[str, str] | None:
        """``(file, what runs Python)`` in this YAML file, its includes and its members, if anything."""
        import yaml
        from lm_eval.tasks._yaml_loader import load_yaml

        path = path.expanduser().resolve()
        if path in self.seen or path.is_relative_to(self.package):
            return None
        self.seen.add(path)
        try:
            node = yaml.compose(path.read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
            cfg = load_yaml(path, resolve_func=False, recursive=False)
        except (OSError, ValueError, yaml.YAMLError):
            return None  # read_task_file reports the requested files; lm-eval skips unreadable ones when indexing
        ref = next(_function_tags(node), None)
        if ref is not None:
            module = ref.rpartition(".")[0].replace(".", "/")
            return str(path), f"!function {ref} runs Python ({path.parent / module}.py)"
        if cfg.get("unsafe_code"):
            return str(path), "unsafe_code: true, the task runs the programs the model writes"
        includes = cfg.get("include") or []
        for inc in includes if isinstance(includes, list) else [includes]:
            inc_path = Path(inc) if Path(inc).is_absolute() else path.parent / inc
            if found := self.file(inc_path):
                return found
        members = cfg.get("task") if "group" in cfg else None
        for item in members if isinstance(members, list) else []:
            name = item if isinstance(item, str) else (item.get("group") or item.get("task")) \
                if isinstance(item, dict) else None
            if isinstance(name, str) and (found := self.entry(name)):
                return found
        return None


def prepare_tasks(tasks: Sequence[str], *, allow_code_execution: bool, with_defaults: bool = True
                  ) -> tuple[list[str], Any]:
    """``(what to ask lm-eval for, a TaskManager)`` for ``--harness-task`` values, checked.

    Task YAML files are asked for by resolved path, group YAML files by their group's name, their
    directories on the manager's include path. With
    ``with_defaults`` the harness's own task folders are indexed too (tens of seconds) when a name is given,
    and an unknown name is an error; without, names outside the files' directories are not checked.

    Raises:
        HarnessTaskError: a file that cannot be loaded, an unknown task name.
        CodeExecutionRefused: a task that would run Python, without ``allow_code_execution``.
    """
    from lm_eval.tasks import TaskManager

    from mg_cli.evaluation.execution import CodeExecutionRefused

    specs, include = [], []
    for t in tasks:
        if is_task_file(t):
            cfg = read_task_file(t)
            p = Path(t).resolve()
            # A group is asked for by name (lm-eval loads a group YAML only from its index); a task by path.
            specs.append(str(cfg["group"]) if "group" in cfg else str(p))
            if str(p.parent) not in include:
                include.append(str(p.parent))
        else:
            specs.append(t)
    names = [t for t in tasks if not is_task_file(t)]
    manager = TaskManager(include_path=include or None, include_defaults=with_defaults and bool(names))
    index = manager.task_index
    if with_defaults:
        unknown = [n for n in names if n not in index]
        if unknown:
            raise HarnessTaskError(f"--harness-task {unknown[0]}: no lm-evaluation-harness task, group or tag of "
                                   f"that name (give a task YAML file, or a name from `lm_eval ls tasks`)")
    if not allow_code_execution:
        finder = _CodeFinder(index)
        for t in tasks:
            found = finder.file(Path(t)) if is_task_file(t) else finder.entry(t)
            if found:
                raise CodeExecutionRefused(*found)
    return specs, manager
