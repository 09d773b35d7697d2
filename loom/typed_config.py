"""Typed tables into dataclasses: TOML-literal overrides, dotted keys, unknown keys with a suggestion, wrong
types and values outside a field's `choice`s — each reported with the dotted key. Knows no loom config."""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
import typing
from dataclasses import field


class ConfigError(ValueError):
    """A configuration problem, phrased for the person who wrote the config."""


def choice(default, *allowed):
    return field(default=default, metadata={"choices": allowed})


def check_positive(values: dict[str, float]) -> None:
    """{dotted key: value}: the first value ≤ 0 is reported with its key."""
    for key, v in values.items():
        if v <= 0:
            raise ConfigError(f"{key} = {v} must be > 0")


def check_non_negative(values: dict[str, float]) -> None:
    for key, v in values.items():
        if v < 0:
            raise ConfigError(f"{key} = {v} must be ≥ 0")


def parse_override(item: str) -> tuple[str, object]:
    """'--train.steps=50' → ('train.steps', 50); the value is read as a TOML literal, else kept as text."""
    body = item[2:] if item.startswith("--") else item
    if "=" not in body:
        raise ConfigError(f"override {item!r} must look like --section.key=value")
    key, raw = body.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip(), value


def set_dotted(data: dict, key: str, value: object) -> None:
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key!r}: {p!r} is a value, not a section")
    node[parts[-1]] = value


def from_dict(cls, data: dict, prefix: str):
    """Builds dataclass `cls` from a dict, rejecting unknown keys and values of the wrong type."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if not isinstance(data, dict):
        raise ConfigError(f"[{prefix.rstrip('.')}] must be a table, got {data!r}")
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(_unknown_key(prefix + key, key, list(fields)))
        typ = _optional_dataclass(hints[key]) or hints[key]
        if value is None and typ is not hints[key]:  # an absent optional table, e.g. from a saved config
            kwargs[key] = None
        elif dataclasses.is_dataclass(typ):
            kwargs[key] = from_dict(typ, value, f"{prefix}{key}.")
        else:
            kwargs[key] = _check_type(prefix + key, value, typ)
    obj = cls(**kwargs)
    for name, f in fields.items():
        allowed = f.metadata.get("choices")
        if allowed and getattr(obj, name) not in allowed:
            raise ConfigError(f"{prefix}{name} = {getattr(obj, name)!r} is not allowed; choose one of {list(allowed)}")
    return obj


def _optional_dataclass(typ):
    """`X | None` with X a dataclass → X (a table that may be absent); anything else → None."""
    if typing.get_origin(typ) in (types.UnionType, typing.Union):
        classes = [a for a in typing.get_args(typ) if dataclasses.is_dataclass(a)]
        return classes[0] if classes else None
    return None


def _unknown_key(dotted: str, key: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown config key {dotted!r}{hint} allowed keys here: {sorted(allowed)}"


def _check_type(key: str, value, typ):
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin in (types.UnionType, typing.Union):  # optional values such as `dict | None`
        for option in args:
            try:
                return _check_type(key, value, option)
            except ConfigError:
                pass
        raise ConfigError(f"{key} = {value!r} has the wrong type; expected {typ}")
    if typ is type(None):
        if value is None:
            return None
        raise ConfigError(f"{key} = {value!r}: expected nothing")
    if dataclasses.is_dataclass(typ):  # a table inside a list, e.g. [[data.sources]]
        return from_dict(typ, value, f"{key}.")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key} = {value!r} must be a list, e.g. {key} = [...]")
        return [_check_type(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is dict and isinstance(value, dict):
        return value
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"{key} = {value!r} must be of type {typ.__name__}, got {type(value).__name__}")
    return value
