"""Dataclass configs from YAML/JSON mappings, checked before any work starts.

    cfg = from_mapping(PointConfig, raw, "experiments/g_sweep.yaml [point x]")

Every field's type comes from its annotation: int, float, bool, str, `Literal[...]`, `X | None`,
`list[X]`, `dict` (free-form, passed through as given) and nested dataclasses. Ranges come from
the field's metadata (`bounded(min=1)`, `bounded(gt=0)`, `bounded(max=1)`, `bounded(pattern=...)`).
An unknown key, a wrong type, a value out of range or outside its choices raises `ConfigError`
naming the source and the key path (`source: responses.length: must be >= 1, got -2`); a
dataclass's own `__post_init__` checks (relations between fields) are reported the same way.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any, Literal, Union


class ConfigError(ValueError):
    """A config value that cannot run; the message names the source and the key path."""


def bounded(
    default=dataclasses.MISSING,
    *,
    default_factory=dataclasses.MISSING,
    min=None,
    max=None,
    gt=None,
    pattern=None,
    doc: str = "",
):
    """A dataclass field with a range or pattern its value must satisfy (checked by `from_mapping`)."""
    metadata = {
        k: v
        for k, v in (("min", min), ("max", max), ("gt", gt), ("pattern", pattern), ("doc", doc))
        if v not in (None, "")
    }
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def from_mapping(cls, raw, source: str = "config", path: str = ""):
    """An instance of the dataclass `cls` from the mapping `raw` (missing keys take their defaults)."""
    if isinstance(raw, cls):
        return raw
    where = path or "<top level>"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {where}: expected a mapping, got {_shown(raw)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in raw if k not in fields]
    if unknown:
        raise ConfigError(f"{source}: {_join(path, unknown[0])}: unknown key (known: {sorted(fields)})")
    hints = typing.get_type_hints(cls)
    values = {
        name: _convert(hints[name], raw[name], fields[name].metadata, source, _join(path, name))
        for name in fields
        if name in raw
    }
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:  # the dataclass's own checks of related fields
        key, _, rest = str(exc).partition(": ")
        if key in fields and rest:  # a message about one field ("field: ...") names its path
            raise ConfigError(f"{source}: {_join(path, key)}: {rest}") from None
        raise ConfigError(f"{source}: {where}: {exc}") from None


def to_mapping(cfg) -> dict:
    """The plain nested dict of a config (what result files record)."""
    return dataclasses.asdict(cfg)


def _join(path: str, key) -> str:
    return f"{path}.{key}" if path else str(key)


def _shown(value) -> str:
    return f"{value!r} ({type(value).__name__})"


def _convert(hint, value, metadata, source: str, path: str):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return _convert_union(args, value, metadata, source, path)
    if origin is Literal:
        if not any(value == a and type(value) is type(a) for a in args):  # True is not 1
            raise ConfigError(f"{source}: {path}: must be one of {list(args)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {path}: expected a list, got {_shown(value)}")
        return [_convert(args[0], v, metadata, source, f"{path}[{i}]") for i, v in enumerate(value)]
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {path}: expected a mapping, got {_shown(value)}")
        return value
    if dataclasses.is_dataclass(hint):
        return from_mapping(hint, value, source, path)
    if hint in (bool, int, float, str):
        return _convert_scalar(hint, value, metadata, source, path)
    if hint is Any:
        return value
    raise TypeError(f"{path}: unsupported config type {hint!r}")  # a config class defect, not user input


def _convert_union(args, value, metadata, source: str, path: str):
    """`value` as the first of a union's types that takes it (None where the union allows it)."""
    if value is None and type(None) in args:
        return None
    options = [a for a in args if a is not type(None)]
    if len(options) == 1:
        return _convert(options[0], value, metadata, source, path)
    for option in options:
        try:
            return _convert(option, value, metadata, source, path)
        except ConfigError:
            pass
    allowed = [_allowed(a, metadata) for a in args]
    raise ConfigError(f"{source}: {path}: must be {' or '.join(allowed)}, got {value!r}")


def _convert_scalar(hint, value, metadata, source: str, path: str):
    """`value` checked as a bool, an int or float (within the field's range) or a str (matching its pattern)."""
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: {path}: expected true or false, got {_shown(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: {path}: expected an integer, got {_shown(value)}")
        return _in_range(value, metadata, source, path)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise ConfigError(f"{source}: {path}: expected a number, got {_shown(value)}")
        return _in_range(float(value), metadata, source, path)
    if not isinstance(value, str):
        raise ConfigError(f"{source}: {path}: expected a string, got {_shown(value)}")
    pattern = metadata.get("pattern")
    if pattern and not re.fullmatch(pattern, value):
        raise ConfigError(f"{source}: {path}: {value!r} does not match {pattern!r}")
    return value


def _in_range(value, metadata, source, path):
    if "min" in metadata and value < metadata["min"]:
        raise ConfigError(f"{source}: {path}: must be >= {metadata['min']}, got {value!r}")
    if "gt" in metadata and value <= metadata["gt"]:
        raise ConfigError(f"{source}: {path}: must be > {metadata['gt']}, got {value!r}")
    if "max" in metadata and value > metadata["max"]:
        raise ConfigError(f"{source}: {path}: must be <= {metadata['max']}, got {value!r}")
    return value


def _allowed(hint, metadata) -> str:
    """What one type admits, in words ("an integer >= 1", "'auto'", "null"): a union's error lists each."""
    origin = typing.get_origin(hint)
    if hint is type(None):
        return "null"
    if origin is Literal:
        return " or ".join(repr(a) for a in typing.get_args(hint))
    if origin is list:
        return "a list"
    if hint is dict or origin is dict or dataclasses.is_dataclass(hint):
        return "a mapping"
    if hint is bool:
        return "true or false"
    if hint in (int, float):
        ranges = [f"{op} {metadata[key]}" for key, op in (("min", ">="), ("gt", ">"), ("max", "<=")) if key in metadata]
        return " ".join(["an integer" if hint is int else "a number", *ranges])
    if hint is str:
        return f"a string matching {metadata['pattern']!r}" if "pattern" in metadata else "a string"
    return str(hint)
