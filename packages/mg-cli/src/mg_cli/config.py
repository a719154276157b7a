"""The run configuration: a YAML file with one section per concern, plus ``--set`` overrides.

The sections' keys are the fields of the packages' own config dataclasses (see
:mod:`mg_cli.sections`), with their names, defaults and docstrings; mg train adds only its own
keys (paths, the loop, logging). Unknown keys are errors that suggest the nearest valid key;
``--set section.key=value`` values are parsed as YAML and type-checked against the field; keys of
earlier releases are accepted with a one-line note. This module imports no torch, so
``mg --help`` stays instant.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml

from mg_cli.schema import ConfigError, Schema, Section, check_type, type_name, variant_name
from mg_cli.sections import SCHEMA

__all__ = ["ConfigError", "RunConfig", "all_keys", "describe", "from_dict", "load_config", "parse_override"]


class RunConfig:
    """A whole run: one :class:`~mg_cli.schema.Section` per YAML section (``config.parallel.tp``)."""

    def __init__(self, sections: dict[str, Section], schema: Schema = SCHEMA, notes: tuple[str, ...] = ()) -> None:
        self.sections = sections
        self.schema = schema
        self.notes = notes
        """One line per renamed key the input used (shown once by ``mg train``)."""

    def __getattr__(self, name: str) -> Section:
        try:
            return self.__dict__["sections"][name]
        except KeyError:
            raise AttributeError(f"no config section '{name}'") from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunConfig) and self.sections == other.sections

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict with YAML key names (round-trips through :func:`from_dict`)."""
        return {name: section.to_dict() for name, section in self.sections.items()}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def values_for(self, cls: type) -> dict[str, Any]:
        """Init arguments of library class ``cls`` gathered from every section that holds its fields."""
        out: dict[str, Any] = {}
        for section in self.sections.values():
            out.update(section.values_for(cls))
        return out

    def make(self, cls: type, **run: Any) -> Any:
        """``cls`` built from the configured values plus the ones the run fills in (``run`` wins).

        Raises:
            ValueError: whatever ``cls`` rejects, in its own words (naming the key).
        """
        return cls(**{**self.values_for(cls), **run})

    def family_class(self, section: str, allow: tuple[str, ...] = ()) -> type:
        """The source class of ``section`` for this run's ``model.type`` (and ``data.format`` for data):
        GPTConfig, BertConfig or T5Config for the model, the family's dataset config for data.

        Raises:
            ConfigError: a key of ``section`` is set that this run does not use (but those in ``allow``,
                which the caller maps itself), or no class serves this family and format.
        """
        family, fmt = self.model.type, self.data.format
        spec = self.schema.spec(section)
        for key in self.sections[section].given():
            if not key.used_by(family, fmt) and key.name not in allow:
                run = family.upper() + (f" with data.format={fmt}" if section == "data" and fmt != "pretrain" else "")
                raise ConfigError(f"{section}.{key.name} is not used by {run} (model.type={family}); it is only "
                                  f"used by model.type={'/'.join(key.variants or ())}; leave it unset")
        for src in spec.sources:
            if src.family in (None, family) and src.format in (None, fmt):
                return src.resolve()
        served = ", ".join(f"{s.family}/{s.format}" for s in spec.sources)
        raise ConfigError(f"data.format={fmt} is not available for model.type={family}; model.type/data.format "
                          f"pairs: {served}")


def all_keys(schema: Schema = SCHEMA) -> list[str]:
    """Every accepted ``section.key``, the renamed ones of earlier releases included."""
    return [f"{s}.{k}" for s in schema.names for k in schema.keys(s)] + list(schema.renamed)


def _suggest(key: str, schema: Schema) -> str:
    keys = [f"{s}.{k}" for s in schema.names for k in schema.keys(s)]
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    if not close and "." in key:
        leaf = key.rsplit(".", 1)[1]
        close = [k for k in keys if k.endswith("." + leaf)][:1]
    return f"; did you mean '{close[0]}'?" if close else f"; valid sections: {', '.join(schema.names)}"


def _renamed(name: str, values: dict[str, Any], source: str, schema: Schema, notes: list[str]) -> dict[str, Any]:
    """``values`` with keys of earlier releases under their new names (a note for each)."""
    out = dict(values)
    for key in list(values):
        old = f"{name}.{key}"
        if old not in schema.renamed:
            continue
        new, value_map = schema.renamed[old]
        new_leaf = new.split(".", 1)[1]
        if new_leaf in values:
            raise ConfigError(f"{source}: both {old} and {new} are set; {old} is the old name of {new}, keep only it")
        value = out.pop(key)
        out[new_leaf] = value_map.get(value, value) if isinstance(value, (str, int, float, bool)) else value
        notes.append(f"config: {old} is now {new} (the old name still works)")
    return out


def from_dict(raw: dict[str, Any] | None, source: str = "config", schema: Schema = SCHEMA) -> RunConfig:
    """Build a validated :class:`RunConfig` from nested dicts.

    Every library class with defaults for all its fields (``ParallelDims``, ``OptimizerConfig``...)
    is constructed from the values, so its own checks run now; the model and dataset classes need
    the tokenizer and are checked when the run builds them (still before any collective).

    Raises:
        ConfigError: unknown section/key (with a suggestion), wrong type, or invalid value.
    """
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections ({', '.join(schema.names)})")
    notes: list[str] = []
    for name, values in raw.items():
        if name not in schema.names:
            close = difflib.get_close_matches(str(name), schema.names, n=1, cutoff=0.5)
            hint = f"did you mean '{close[0]}'?" if close else f"valid sections: {', '.join(schema.names)}"
            raise ConfigError(f"{source}: unknown section '{name}'; {hint}")
        if values is not None and not isinstance(values, dict):
            raise ConfigError(f"{source}: section '{name}' must be a mapping of keys to values")
    sections = {}
    for spec in schema.sections:
        keys = schema.keys(spec.name)
        values = {}
        for key, value in _renamed(spec.name, raw.get(spec.name) or {}, source, schema, notes).items():
            full = f"{spec.name}.{key}"
            if key not in keys:
                raise ConfigError(f"{source}: unknown key '{full}'{_suggest(full, schema)}")
            try:
                values[key] = check_type(value, keys[key].type, full)
            except ConfigError as e:
                raise ConfigError(f"{source}: {e}") from None
        section = Section(spec, keys, values)
        if spec.cli is not None:
            try:
                spec.cli(**section.cli_values())
            except ConfigError as e:
                raise ConfigError(f"{source}: {e}") from None
        sections[spec.name] = section
    config = RunConfig(sections, schema, tuple(notes))
    for cls in schema.source_classes():
        if _constructible(cls):
            try:
                config.make(cls)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"{source}: {e}") from None
    return config


def _constructible(cls: type) -> bool:
    """Whether ``cls`` has a default for every init field (so the config alone can build it)."""
    import dataclasses

    from mg_cli.schema import has_default

    return all(has_default(f) for f in dataclasses.fields(cls) if f.init)


def parse_override(text: str, schema: Schema = SCHEMA) -> tuple[str, str, Any]:
    """Parse ``section.key=value`` (value as YAML) into ``(section, key, value)``."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. --set train.iters=100")
    key, _, raw_value = text.partition("=")
    key = key.strip()
    if key.count(".") != 1:
        raise ConfigError(f"--set {text!r}: the key must be section.key{_suggest(key, schema)}")
    section, leaf = key.split(".")
    try:
        value = yaml.safe_load(raw_value) if raw_value.strip() else None
    except yaml.YAMLError:
        value = raw_value
    return section, leaf, value


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (),
                schema: Schema = SCHEMA) -> RunConfig:
    """Read the YAML file at ``path`` (or start from defaults), apply ``--set`` overrides, validate.

    Raises:
        ConfigError: missing/unreadable/invalid YAML, unknown keys, wrong types or invalid values.
    """
    raw: dict[str, Any] = {}
    source = "--set" if overrides else "defaults"
    if path is not None:
        source = str(path)
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {path} does not exist; pass --config FILE.yaml with a valid path")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"{path}{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections ({', '.join(schema.names)})")
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for text in overrides:
        section, leaf, value = parse_override(text, schema)
        if raw.get(section) is None:  # absent, or an empty `section:` line
            raw[section] = {}
        if not isinstance(raw[section], dict):
            raise ConfigError(f"{source}: section '{section}' must be a mapping of keys to values, not "
                              f"{raw[section]!r}; fix it before --set {text!r} can apply")
        raw[section][leaf] = value
    return from_dict(raw, source, schema)


def describe(schema: Schema = SCHEMA) -> str:
    """Every key with its default, type and help (the field's docstring), for ``mg train --list-keys``."""
    lines = []
    for spec in schema.sections:
        lines.append(f"{spec.name}:  # {spec.doc}")
        every = {variant_name(src) for src in spec.sources}
        for key in schema.keys(spec.name).values():
            used = key.variants
            where = f" [{'/'.join(used)}]" if used is not None and set(used) != every else ""
            lines.append(f"  {key.name}: {key.default!r}  # {type_name(key.type)}{where}; {key.doc}")
    if schema.renamed:
        lines.append("# renamed keys (the old names still work):")
        lines.extend(f"#   {old} -> {new}" for old, (new, _) in schema.renamed.items())
    return "\n".join(lines)
