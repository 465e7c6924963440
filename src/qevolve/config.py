"""Typed configuration: one pydantic model per stage, loaded from YAML with ``key=value`` overrides.

Every stage of the pipeline (data, environments, BC, rollouts, critic, labelling, policy, evolve)
owns one config class derived from :class:`StageConfig`. Each field carries its default and a
description, so ``qevolve STAGE --show-config`` documents the whole surface (:func:`render_config`).
Unknown keys (with the closest field names) and values of the wrong type fail at start-up with the
dotted name of the offending field.

A config that composes others (``qevolve evolve``'s) may decide some of its sections' fields itself:
``derived_fields`` maps them to the field that decides them. Setting one in a YAML file or an override
is an error naming that field, and :func:`strip_derived` leaves them out of what a run records.
"""

from __future__ import annotations

import difflib
import json
import shutil
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = ["StageConfig", "ConfigError", "Derived", "load_config", "apply_overrides", "describe_config",
           "render_config", "strip_derived", "find_derived"]

C = TypeVar("C", bound="StageConfig")


class ConfigError(ValueError):
    """A configuration problem, with a one-line message naming the field or file."""


@dataclass(frozen=True)
class Derived:
    """A field that a composing config sets itself: from the field ``decider`` (a dotted name of the same
    config; ``None``: from what the program computes, e.g. a run folder), and why, in words."""

    decider: str | None
    why: str


class StageConfig(BaseModel):
    """Base class of every stage config: extra keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    #: dotted field (``*`` = any key of a mapping) -> how it is decided; see the module docstring
    derived_fields: ClassVar[dict[str, Derived]] = {}


def find_derived(cls: type[BaseModel], dotted: str) -> tuple[str, Derived] | None:
    """The entry of ``cls.derived_fields`` that decides ``dotted`` (the field itself or a part of it): the
    most specific pattern that is a prefix of it, with the field name its pattern stands for."""
    parts = dotted.split(".")
    best: tuple[str, Derived] | None = None
    best_length = -1
    for pattern, derived in getattr(cls, "derived_fields", {}).items():
        keys = pattern.split(".")
        if len(keys) <= len(parts) and len(keys) > best_length and \
                all(key in ("*", part) for key, part in zip(keys, parts)):
            best, best_length = (".".join(parts[:len(keys)]), derived), len(keys)
    return best


def derived_message(cls: type[BaseModel], dotted: str) -> str | None:
    """Why ``dotted`` may not be set (None when it may)."""
    found = find_derived(cls, dotted)
    if found is None:
        return None
    field, derived = found
    if derived.decider is None:
        return f"{dotted} is not a setting ({derived.why}); remove it"
    decider = derived.decider + dotted[len(field):]
    return f"{dotted} is decided by {decider} ({derived.why}); set {decider} instead"


def _leaf_paths(tree: Any, prefix: str = "") -> list[str]:
    if isinstance(tree, dict) and tree:
        return [path for key, value in tree.items() for path in _leaf_paths(value, f"{prefix}{key}.")]
    return [prefix[:-1]] if prefix else []


def strip_derived(cls: type[BaseModel], tree: dict[str, Any]) -> dict[str, Any]:
    """A copy of the (dumped) ``tree`` without the fields ``cls`` decides itself: what a run records."""
    def walk(node: Any, prefix: str) -> Any:
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            found = find_derived(cls, dotted)
            if found is not None and found[0] == dotted:
                continue
            out[key] = walk(value, dotted + ".")
        return out
    return walk(tree, "")


def _parse_override_value(text: str) -> Any:
    """Parse the right-hand side of ``key=value`` as YAML so numbers, booleans and lists work."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = {}
            node[part] = child
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def value_at(tree: Any, dotted: str) -> Any:
    """The value at a dotted path of a JSON tree (a config or a run's manifest), or "<missing>"."""
    for part in dotted.split("."):
        tree = tree.get(part, "<missing>") if isinstance(tree, dict) else "<missing>"
    return tree


def apply_overrides(tree: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """Apply ``a.b=value`` strings to a nested dict (in place) and return it."""
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value")
        key, _, raw = item.partition("=")
        key = key.strip()
        if not key:
            raise ConfigError(f"override {item!r}: empty key")
        _set_dotted(tree, key, _parse_override_value(raw))
    return tree


def _unwrap(annotation: Any) -> Any:
    """The config class inside ``X | None``, ``dict[str, X]`` or ``list[X]`` (else the annotation)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if len(models) == 1 else annotation
    return annotation


def _model_at(cls: type[BaseModel], parts: list[str]) -> type[BaseModel] | None:
    """The config class that holds the field ``parts`` (its section), or None."""
    node: Any = cls
    index = 0
    while index < len(parts):
        if not (isinstance(node, type) and issubclass(node, BaseModel)) or parts[index] not in node.model_fields:
            return None
        node = _unwrap(node.model_fields[parts[index]].annotation)
        index += 1
        if typing.get_origin(node) is dict and index < len(parts):  # e.g. variants.NAME: skip the key
            node = _unwrap(typing.get_args(node)[1])
            index += 1
    return node if isinstance(node, type) and issubclass(node, BaseModel) else None


def did_you_mean(cls: type[BaseModel] | None, loc: list[str]) -> str:
    """`` (did you mean 'a.b.epochs'?)`` for an unknown field ``loc`` of ``cls`` when a sibling is close."""
    if cls is None or not loc:
        return ""
    section = _model_at(cls, [str(p) for p in loc[:-1]])
    if section is None:
        return ""
    close = difflib.get_close_matches(str(loc[-1]), list(section.model_fields), n=2, cutoff=0.6)
    if not close:
        return ""
    head = ".".join(str(p) for p in loc[:-1])
    names = " or ".join(repr(f"{head}.{name}" if head else name) for name in close)
    return f" (did you mean {names}?)"


def _format_validation_error(err: ValidationError, source: str, cls: type[BaseModel] | None = None) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "<root>"
    kind = first["type"]
    if kind == "extra_forbidden":
        return f"{source}: unknown field {loc!r}{did_you_mean(cls, list(first['loc']))}"
    given = first.get("input")
    given_text = json.dumps(given, default=str) if not isinstance(given, dict) else "a mapping"
    if len(given_text) > 60:
        given_text = given_text[:57] + "..."
    return f"{source}: field {loc!r}: {first['msg']} (got {given_text})"


def build_config(cls: type[C], tree: dict[str, Any], source: str = "config") -> C:
    """Validate a nested dict into ``cls``; raise :class:`ConfigError` with a one-line message."""
    try:
        return cls.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source, cls)) from None


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(tree).__name__}")
    return tree


def merge_trees(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` laid over it, mapping by mapping (a new dict; neither is changed)."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge_trees(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else value
    return out


def _blame(loc: list[str], path: str | Path | None, overrides: list[str] | None, base_source: str) -> str:
    """Who set the field ``loc``: the last override of it, else the YAML file, else ``base_source``."""
    for item in reversed(overrides or []):  # the last override of a key is the one that counts
        key = [part.strip() for part in item.partition("=")[0].split(".")]
        if loc and (loc[:len(key)] == key or key[:len(loc)] == loc):
            return f"override {item!r}"
    return str(path) if path is not None else base_source


def load_config(cls: type[C], path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict[str, Any] | None = None, base_source: str = "config") -> C:
    """Load ``cls`` from ``base`` (e.g. settings recorded with a checkpoint), an optional YAML file laid
    over it, then ``key=value`` overrides.

    An invalid value is blamed on the override that set it (``override 'epochs=x': ...``), else on
    the YAML file (else ``base_source``). A field that ``cls`` decides itself (``derived_fields``) is
    refused, naming the field that decides it."""
    tree = merge_trees(base or {}, read_yaml(path) if path is not None else {})
    apply_overrides(tree, overrides)
    for leaf in _leaf_paths(tree):
        message = derived_message(cls, leaf)
        if message is not None:
            raise ConfigError(f"{_blame(leaf.split('.'), path, overrides, base_source)}: {message}")
    try:
        return cls.model_validate(tree)
    except ValidationError as err:
        loc = [str(p) for p in err.errors()[0]["loc"]]
        raise ConfigError(_format_validation_error(err, _blame(loc, path, overrides, base_source), cls)) from None


def describe_config(cls: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str, str]]:
    """Rows of (dotted name, type, default, description) for documentation and ``config show``."""
    rows: list[tuple[str, str, str, str]] = []
    for name, field in cls.model_fields.items():
        dotted = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.extend(describe_config(annotation, dotted + "."))
            continue
        type_name = getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")
        default = field.get_default(call_default_factory=True)
        rows.append((dotted, type_name, json.dumps(default, default=str), field.description or ""))
    return rows


def dump_config(config: BaseModel) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


# ------------------------------------------------------------------------------------ --show-config

#: the widest line :func:`render_config` writes (fits a side-by-side terminal)
SHOW_WIDTH = 100


def _yaml_value(value: Any) -> str:
    """``value`` as one line of YAML flow style."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000, allow_unicode=True).strip()
    return text[:-4].rstrip() if text.endswith("\n...") else text


def _value_lines(name: str, value: Any, indent: str, width: int) -> list[str]:
    """``name: value`` within ``width`` columns: on one line when it fits, else as an indented YAML block
    (long strings folded at spaces, which YAML reads back as the same string)."""
    line = f"{indent}{name}: {_yaml_value(value)}"
    if len(line) <= width:
        return [line]
    if isinstance(value, (dict, list)) and value:
        # PyYAML breaks a long string at the first space past its width: leave room for one word
        block = yaml.safe_dump(value, default_flow_style=False, sort_keys=False, allow_unicode=True,
                               width=max(width - len(indent) - 24, 20))
        return [f"{indent}{name}:"] + [f"{indent}  {row}" for row in block.rstrip().splitlines()]
    if isinstance(value, str):
        block = yaml.safe_dump({name: value}, default_flow_style=False, allow_unicode=True,
                               width=max(width - len(indent) - 24, 20)).rstrip()
        rows = block.splitlines()
        return [f"{indent}{rows[0]}"] + [f"{indent}{row}" for row in rows[1:]]
    return [line]


def _comment(text: str, indent: str, width: int) -> list[str]:
    return textwrap.wrap(text, width=max(width - len(indent) - 2, 30), initial_indent=f"{indent}# ",
                         subsequent_indent=f"{indent}#   ", break_on_hyphens=False) if text else []


def _section_class(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def render_config(cls: type[BaseModel], config: BaseModel | None = None, header: list[str] | None = None,
                  width: int | None = None) -> str:
    """``config`` (None: the defaults of ``cls``) as commented YAML for ``--show-config``: every field under
    its section with its description on wrapped comment lines above it (and its default where the value
    differs), at most ``width`` columns (default: the terminal's, at most :data:`SHOW_WIDTH`). Fields that
    ``cls`` decides itself appear as comments naming what decides them. The text loads back as the same
    config (the comments aside)."""
    width = width or min(SHOW_WIDTH, max(shutil.get_terminal_size((SHOW_WIDTH, 24)).columns, 60))
    defaults = cls().model_dump(mode="json")
    values = config.model_dump(mode="json") if config is not None else defaults
    lines = [row for text in header or [] for row in _comment(text, "", width)]

    def walk(section: type[BaseModel], tree: dict[str, Any], default_tree: Any, prefix: str, indent: str) -> None:
        default_tree = default_tree if isinstance(default_tree, dict) else {}
        for name, field in section.model_fields.items():
            dotted = prefix + name
            found = find_derived(cls, dotted)
            if found is not None and found[0] == dotted:
                derived = found[1]
                what = f"set from {derived.decider}" if derived.decider else "not a setting"
                lines.extend(_comment(f"{name}: {what} ({derived.why})", indent, width))
                continue
            description = field.description or ""
            value, default = tree.get(name), default_tree.get(name)
            sub = _section_class(field.annotation)
            if sub is not None and isinstance(value, dict):
                lines.extend(_comment(description, indent, width))
                lines.append(f"{indent}{name}:")
                walk(sub, value, default, dotted + ".", indent + "  ")
                continue
            if value != default:
                description = f"{description} (default: {_yaml_value(default)})".strip()
            lines.extend(_comment(description, indent, width))
            lines.extend(_value_lines(name, value, indent, width))

    walk(cls, values, defaults, "", "")
    return "\n".join(lines)
