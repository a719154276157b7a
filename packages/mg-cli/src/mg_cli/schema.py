"""How configuration keys are derived from dataclasses: sources, keys, section values and type checks.

A section (:class:`SectionSpec`) lists its *sources*: library dataclasses whose init fields become
its keys under the same names (optionally with a prefix, a subset, or the fields a run fills in
left out), and an optional dataclass of keys only the command has. Help text is each field's
docstring. Values are type-checked against the field's annotation; each constraint stays in the
dataclass that owns it, which is constructed from the section's values to check them.
"""

from __future__ import annotations

import ast
import collections.abc
import dataclasses
import functools
import importlib
import inspect
import keyword
import operator
import textwrap
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal


class ConfigError(ValueError):
    """A configuration problem, with a message naming the key and the fix."""


@dataclass(frozen=True)
class Source:
    """A library dataclass whose init fields are keys of a section."""

    cls: str | type
    """The class, or ``"module:Class"`` (imported when first needed)."""
    family: str | None = None
    """Only for this ``model.type`` (its keys are errors for the other families); None: every family."""
    format: str | None = None
    """Only for this ``data.format`` (data sources: ``pretrain``, ``sft``...); None: every format."""
    only: tuple[str, ...] = ()
    """Just these fields (the class's other fields are keys of another section)."""
    exclude: tuple[str, ...] = ()
    """Fields the run fills in itself (not keys)."""
    prefix: str = ""
    """Prepended to the field names to make the keys (``recompute_`` + ``granularity``)."""

    def resolve(self) -> type:
        """The class itself."""
        if isinstance(self.cls, str):
            module, _, name = self.cls.partition(":")
            return getattr(importlib.import_module(module), name)
        return self.cls

    def fields(self) -> list[dataclasses.Field]:
        """The init fields that are keys."""
        out = [f for f in dataclasses.fields(self.resolve()) if f.init and f.name not in self.exclude]
        return [f for f in out if f.name in self.only] if self.only else out


@dataclass(frozen=True, eq=False)
class SectionSpec:
    """One YAML section: its library sources and the command's own keys."""

    name: str
    """The section's YAML name."""
    doc: str
    """One line for ``--list-keys``."""
    cli: type | None = None
    """A dataclass of keys only the command has (paths, the loop, logging); listed after the sources'."""
    sources: tuple[Source, ...] = ()
    """Library dataclasses whose fields are keys; a name in several (``split``) is one key."""
    defaults: collections.abc.Mapping[str, Any] = field(default_factory=dict)
    """The command's defaults where they differ from the library's (``optim.lr``)."""
    unset_is_null: bool = False
    """Source keys default to null, meaning "not given": the model preset or the class's own default applies."""


@dataclass(frozen=True)
class Owner:
    """Where a key's value goes: a field of a source (or of the section's own dataclass when source is None)."""

    source: Source | None
    field: dataclasses.Field


@dataclass(frozen=True)
class Key:
    """One ``section.key``: its type, default, help and the fields it sets."""

    name: str
    attr: str
    """Attribute name on the section's values (``async`` is ``async_``)."""
    type: Any
    default: Any
    doc: str
    owners: tuple[Owner, ...]

    @property
    def families(self) -> tuple[str, ...] | None:
        """The model families that use this key; None: all of them."""
        fams = [o.source.family for o in self.owners if o.source is not None]
        if len(fams) < len(self.owners) or None in fams:
            return None
        return tuple(dict.fromkeys(fams))  # type: ignore[arg-type]

    @property
    def variants(self) -> tuple[str, ...] | None:
        """Where this key is used, as ``family`` or ``family with data.format=F``; None: everywhere."""
        if self.families is None:
            return None
        return tuple(dict.fromkeys(
            variant_name(o.source) for o in self.owners if o.source is not None))

    def used_by(self, family: str, data_format: str) -> bool:
        """Whether a run of ``family`` reading ``data_format`` data uses this key."""
        return any(o.source is None or ((o.source.family in (None, family))
                                         and (o.source.format in (None, data_format))) for o in self.owners)


def variant_name(source: Source) -> str:
    """``gpt``, or ``gpt with data.format=sft`` for a source of another format than pretraining's."""
    fmt = f" with data.format={source.format}" if source.format not in (None, "pretrain") else ""
    return f"{source.family}{fmt}"


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass and of its bases (the class's own win), one line each."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for stmt, after in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[stmt.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def has_default(f: dataclasses.Field) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING  # type: ignore[misc]


@dataclass(frozen=True)
class Schema:
    """Every section of a command's configuration, and the renamed keys it still accepts."""

    sections: tuple[SectionSpec, ...]
    renamed: collections.abc.Mapping[str, tuple[str, collections.abc.Mapping[Any, Any]]] = field(default_factory=dict)
    """Old ``section.key`` -> (new ``section.key``, old value -> new value where they differ)."""

    def spec(self, name: str) -> SectionSpec:
        return next(s for s in self.sections if s.name == name)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sections]

    def replace(self, old: str | type, new: type) -> Schema:
        """This schema with source class ``old`` replaced by ``new`` (e.g. a subclass with more fields)."""
        def swap(src: Source) -> Source:
            hit = src.cls == old or (not isinstance(old, str) and src.resolve() is old)
            return dataclasses.replace(src, cls=new) if hit else src
        return dataclasses.replace(self, sections=tuple(
            dataclasses.replace(s, sources=tuple(swap(src) for src in s.sources)) for s in self.sections))

    def keys(self, section: str) -> dict[str, Key]:
        """The keys of ``section`` by YAML name: the sources' (in order), then the command's own."""
        return _keys(self.spec(section))

    def source_classes(self) -> list[type]:
        """Every library class the sections draw on, once."""
        return list(dict.fromkeys(src.resolve() for s in self.sections for src in s.sources))


@functools.cache
def _keys(spec: SectionSpec) -> dict[str, Key]:
    found: dict[str, list[Owner]] = {}
    types_: dict[str, list[Any]] = {}
    for src in spec.sources:
        cls = src.resolve()
        hints = typing.get_type_hints(cls)
        for f in src.fields():
            name = src.prefix + f.name
            found.setdefault(name, []).append(Owner(src, f))
            types_.setdefault(name, []).append(hints[f.name])
    if spec.cli is not None:
        hints = typing.get_type_hints(spec.cli)
        for f in dataclasses.fields(spec.cli):
            name = f.metadata.get("yaml_name", f.name)
            found[name] = [Owner(None, f)]
            types_[name] = [hints[f.name]]
    keys = {}
    for name, owners in found.items():
        tp = functools.reduce(operator.or_, dict.fromkeys(types_[name]))
        own = owners[0]
        if own.source is None:
            default, attr = _default(own.field), own.field.name
        else:
            attr = name + "_" if keyword.iskeyword(name) else name
            if spec.unset_is_null:
                default, tp = None, tp | None
            elif name in spec.defaults:
                default = spec.defaults[name]
            else:
                default = _default(own.field)
                if not has_default(own.field):
                    tp = tp | None
        docs = [field_docs(o.source.resolve() if o.source else spec.cli).get(o.field.name, "") for o in owners]
        keys[name] = Key(name=name, attr=attr, type=tp, default=default, doc=next((d for d in docs if d), ""),
                         owners=tuple(owners))
    return keys


class Section:
    """One section's values, read as attributes (``config.train.iters``)."""

    def __init__(self, spec: SectionSpec, keys: dict[str, Key], values: dict[str, Any]) -> None:
        self._spec, self._keys = spec, keys
        self._values = {k.attr: values.get(name, k.default) for name, k in keys.items()}

    def __getattr__(self, attr: str) -> Any:
        try:
            return self.__dict__["_values"][attr]
        except KeyError:
            raise AttributeError(f"section '{self.__dict__['_spec'].name}' has no key '{attr}'") from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Section) and self._spec.name == other._spec.name and self._values == other._values

    def __repr__(self) -> str:
        return f"Section({self._spec.name}: {self._values})"

    def to_dict(self) -> dict[str, Any]:
        """YAML name -> value, every key."""
        return {name: self._values[k.attr] for name, k in self._keys.items()}

    def given(self) -> list[Key]:
        """The keys whose value is not their default."""
        return [k for k in self._keys.values() if self._values[k.attr] != k.default]

    def values_for(self, cls: type) -> dict[str, Any]:
        """Init arguments of ``cls`` (one of the sources) from this section, leaving out values the class's
        own default would give anyway (and, in a section whose keys default to null, the unset ones)."""
        out = {}
        for k in self._keys.values():
            value = self._values[k.attr]
            for o in k.owners:
                if o.source is None or o.source.resolve() is not cls:
                    continue
                if self._spec.unset_is_null and value is None:
                    continue
                if has_default(o.field) and value == _default(o.field):
                    continue
                out[o.field.name] = value
        return out

    def cli_values(self) -> dict[str, Any]:
        """Init arguments of the section's own dataclass."""
        return {k.owners[0].field.name: self._values[k.attr] for k in self._keys.values()
                if k.owners[0].source is None}


def check_type(value: Any, tp: Any, key: str) -> Any:
    """Return ``value`` converted to ``tp`` where lossless (int -> float), else raise ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return check_type(value, arg, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}={value!r} has the wrong type; expected {type_name(tp)}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{key} expected null")
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        choices = ", ".join(repr(a) for a in typing.get_args(tp))
        raise ConfigError(f"{key}={value!r} is not one of {choices}")
    if origin in (list, tuple, collections.abc.Sequence) or tp is list:
        if isinstance(value, list):
            return value
        raise ConfigError(f"{key}={value!r} should be a list")
    if origin is dict or tp is dict:
        if isinstance(value, dict):
            return value
        raise ConfigError(f"{key}={value!r} should be a mapping ({{name: value, ...}})")
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"{key}={value!r} has the wrong type; expected {type_name(tp)}")


def type_name(tp: Any) -> str:
    """A type as ``--list-keys`` shows it."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(type_name(a) for a in typing.get_args(tp)))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))
