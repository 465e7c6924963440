"""Typed configuration: one pydantic model per stage, loaded from YAML with ``key=value`` overrides.

Every stage of the pipeline (data, environments, BC, rollouts, critic, labelling, policy, evolve)
owns one config class derived from :class:`StageConfig`. Each field carries its default and a
description, so ``qevolve config show STAGE`` documents the whole surface. Unknown keys and
values of the wrong type fail at start-up with the dotted name of the offending field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = ["StageConfig", "ConfigError", "load_config", "apply_overrides", "describe_config"]

C = TypeVar("C", bound="StageConfig")


class ConfigError(ValueError):
    """A configuration problem, with a one-line message naming the field or file."""


class StageConfig(BaseModel):
    """Base class of every stage config: extra keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


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


def _format_validation_error(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "<root>"
    kind = first["type"]
    if kind == "extra_forbidden":
        return f"{source}: unknown field {loc!r}"
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
        raise ConfigError(_format_validation_error(err, source)) from None


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


def load_config(cls: type[C], path: str | Path | None = None, overrides: list[str] | None = None) -> C:
    """Load ``cls`` from an optional YAML file plus ``key=value`` overrides.

    An invalid value is blamed on the override that set it (``override 'epochs=x': ...``), else on
    the YAML file."""
    tree = read_yaml(path) if path is not None else {}
    apply_overrides(tree, overrides)
    source = str(path) if path is not None else "config"
    try:
        return cls.model_validate(tree)
    except ValidationError as err:
        loc = [str(p) for p in err.errors()[0]["loc"]]
        for item in reversed(overrides or []):  # the last override of a key is the one that counts
            key = [part.strip() for part in item.partition("=")[0].split(".")]
            if loc and (loc[:len(key)] == key or key[:len(loc)] == loc):
                source = f"override {item!r}"
                break
        raise ConfigError(_format_validation_error(err, source)) from None


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
