"""A tree of configuration dataclasses built from nested mappings (a parsed TOML file) with
``KVTIER_<SECTION>__<KEY>`` environment overrides, and documented field by field.

Each field's metadata (kvtier/server/config.py's ``_f``) carries its documentation (``doc``), its
validator (``check``, returning a complaint or None) and its kind (``path``: resolved against the
config file's directory). Every failure is a ConfigError whose message starts with the dotted
field name, and names the environment variable when the value came from one.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError

ENV_PREFIX = "KVTIER_"
ENV_SEP = "__"


class EnvValue(str):
    """A string that came from the environment: converted to the field's type when building.

    ``var`` names the variable, so an error can say where a bad value came from.
    """


def env_overrides(env: Mapping[str, str]) -> Iterator[tuple[list[str], EnvValue]]:
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or ENV_SEP not in name:
            continue  # e.g. KVTIER_MASTER_KEY: not a config override
        parts = name[len(ENV_PREFIX) :].lower().split(ENV_SEP)
        if not all(parts):
            raise ConfigError(f"{name}: malformed override name (expected KVTIER_<SECTION>__<KEY>)")
        v = EnvValue(env[name])
        v.var = name
        yield parts, v


def set_path(data: dict[str, Any], parts: list[str], value: Any) -> None:
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: is a value, not a section (override {value.var})")
        node = child
    node[parts[-1]] = value


def deep_copy(v: Any) -> Any:
    return {k: deep_copy(x) for k, x in v.items()} if isinstance(v, Mapping) else v


def hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def build(cls: type, data: Any, prefix: str, base: Path) -> Any:
    """An instance of the dataclass ``cls`` from the mapping ``data`` (``prefix``: its dotted place
    in the tree, for errors; ``base``: what relative ``path`` fields are resolved against): unknown
    and missing fields, wrong types and values a field's ``check`` refuses are ConfigErrors."""
    where = prefix.rstrip(".") or "config"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must be a table (section), got {type(data).__name__}")
    types_of = hints(cls)
    known = {f.name for f in fields(cls)}
    for k in data:
        if k not in known:
            raise ConfigError(f"{prefix}{k}: unknown field; known fields of {where}: {sorted(known)}")
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        name = prefix + f.name
        tp, optional = unwrap_optional(types_of[f.name])
        if f.name not in data:
            if is_dataclass(tp) and not optional:
                kwargs[f.name] = build(tp, {}, name + ".", base)
            elif f.default is MISSING and f.default_factory is MISSING:
                raise ConfigError(f"{name}: required")
            continue
        value = data[f.name]
        if is_dataclass(tp):
            kwargs[f.name] = build(tp, value, name + ".", base)
            continue
        value = convert(name, tp, optional, value)
        if value is None:
            kwargs[f.name] = None
            continue
        check = f.metadata.get("check")
        complaint = check(value) if check else None
        if complaint is not None:
            raise ConfigError(f"{name}: {complaint}{origin(data[f.name])}")
        if f.metadata.get("kind") == "path":
            value = str((base / value).resolve()) if not Path(value).is_absolute() else value
        kwargs[f.name] = value
    return cls(**kwargs)


def origin(value: Any) -> str:
    return f" (from {value.var})" if isinstance(value, EnvValue) else ""


_BOOLS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}
_TYPE_WORDS = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}


def convert(name: str, tp: Any, optional: bool, value: Any) -> Any:
    """Type-check a TOML value, or parse an environment string into the field's type."""
    if isinstance(value, EnvValue):
        text = str(value).strip()
        if optional and text == "":
            return None
        try:
            if tp is bool:
                return _BOOLS[text.lower()]
            if tp is int:
                return int(text, 0) if text.lower().startswith(("0x", "0o", "0b")) else int(text)
            if tp is float:
                return float(text)
        except (KeyError, ValueError):
            raise ConfigError(f"{name}: must be {_TYPE_WORDS[tp]}, got {text!r} (from {value.var})") from None
        return str(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is str and optional and value == "":
        return None
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        hint = "must be a positive integer" if tp is int else f"must be {_TYPE_WORDS.get(tp, tp.__name__)}"
        raise ConfigError(f"{name}: {hint}, got {type(value).__name__} {value!r}")
    return value


@dataclass(slots=True, frozen=True)
class FieldDoc:
    """One row of the configuration reference."""

    path: str
    type: str
    default: str
    env: str
    doc: str


def walk(cls: type, prefix: str, rows: list[FieldDoc]) -> None:
    """Append a row for every field of ``cls``, sections flattened to dotted names."""
    types_of = hints(cls)
    for f in fields(cls):
        tp, optional = unwrap_optional(types_of[f.name])
        name = prefix + f.name
        if is_dataclass(tp):
            walk(tp, name + ".", rows)
            continue
        if f.default is not MISSING:
            default = "(unset)" if f.default is None else repr(f.default).lower() if tp is bool else repr(f.default)
        else:
            default = "(required)"
        word = "path" if f.metadata.get("kind") == "path" else {int: "integer", float: "number", bool: "boolean",
                                                                  str: "string"}[tp]
        env = ENV_PREFIX + ENV_SEP.join(name.split(".")).upper()
        rows.append(FieldDoc(name, word + (" (optional)" if optional else ""), default, env, f.metadata["doc"]))


__all__ = ["ENV_PREFIX", "ENV_SEP", "EnvValue", "FieldDoc", "build", "deep_copy", "env_overrides", "set_path", "walk"]
