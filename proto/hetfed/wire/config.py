"""Strict loading of frozen config dataclasses from TOML/JSON mappings.

Validation happens once, on load: an unknown or misspelled field, a missing required field or a
value of the wrong type is a ``ConfigError`` naming the field's full path (and the closest valid
name for a typo). Dataclasses add their own range checks in ``__post_init__``. A field whose type
depends on another field's value (a run's algorithm config on its algorithm) is declared with
``dependent``: the loader hands its table to the field's own parser, once, with its siblings' values.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
import types
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is missing, misspelled, mistyped or out of range."""


@dataclass(frozen=True)
class Dependent:
    """How the loader builds a field whose type depends on its siblings' values (see ``dependent``)."""

    # (value, siblings, where) -> the field's typed value; ``where`` is the field's path, for the parser's errors.
    parse: Callable[[Any, Mapping[str, Any], str], Any]
    # siblings -> the field's value when its table leaves it out. ``parse`` must fill what a given table leaves out
    # from the same value: ``to_sparse_mapping`` writes only what differs from it.
    default: Callable[[Mapping[str, Any]], Any]


_DEPENDENT = "hetfed.wire.config.dependent"


def dependent(parse: Callable[[Any, Mapping[str, Any], str], Any],
              default: Callable[[Mapping[str, Any]], Any]) -> dict[str, Dependent]:
    """The metadata of a dataclass field that ``from_mapping`` builds with ``parse(value, siblings, where)``, or
    ``default(siblings)`` when the table leaves it out, after every other field of its table (``siblings`` holds
    their values, converted or defaulted): ``field(kw_only=True, metadata=dependent(parse, default))``. The field's type hint
    is not used, the parser decides the type; with ``kw_only`` it needs no Python default. A ``ValueError`` (not a
    ``ConfigError``) from either is reported at the table's path, like a range check's."""
    return {_DEPENDENT: Dependent(parse, default)}


def _dependent_of(f: dataclasses.Field[Any]) -> Dependent | None:
    return f.metadata.get(_DEPENDENT)


def _describe(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, where: str) -> Any:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        others = [a for a in args if a is not type(None)]
        if len(others) == 1:  # `X | None`: X's own error names the field and the close match
            return _convert(value, others[0], where)
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{where}: expected {_describe(tp)}, got {value!r}")
    if origin is Literal:
        if value not in get_args(tp):
            choices = ", ".join(repr(a) for a in get_args(tp))
            raise ConfigError(f"{where}: must be one of {choices}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a table of fields, got {type(value).__name__}")
        return from_mapping(tp, value, where)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        args = get_args(tp)
        item_tp = args[0] if args else Any
        items = [_convert(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a table, got {value!r}")
        _, val_tp = get_args(tp) or (str, Any)
        return {str(k): _convert(v, val_tp, f"{where}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported config type {_describe(tp)}")


def from_mapping(cls: type[T], data: Mapping[str, Any], where: str = "config") -> T:
    """Build dataclass ``cls`` from a mapping, rejecting unknown, missing and ill-typed fields."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a table of fields, got {type(data).__name__}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, list(fields), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else f"; valid fields: {', '.join(sorted(fields))}"
        raise ConfigError(f"{where}: unknown field '{key}'{hint}")
    kwargs: dict[str, Any] = {}
    dependents = {name: dep for name, f in fields.items() if (dep := _dependent_of(f)) is not None}
    for name, f in fields.items():
        if name in dependents:
            continue
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], f"{where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}: missing required field '{name}'")
    # A dependent field sees every other field's value, given or defaulted, as the built object will hold it.
    others = {name: _default_of(f) for name, f in fields.items() if name not in dependents and name not in kwargs}
    for name, dep in dependents.items():
        siblings = {**others, **kwargs}
        try:
            kwargs[name] = dep.parse(data[name], siblings, f"{where}.{name}") if name in data else dep.default(siblings)
        except ConfigError:
            raise
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from exc
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        # Range checks in __post_init__ know their field, not where the table sits: add the path.
        raise ConfigError(f"{where}: {exc}") from exc


def to_mapping(obj: Any) -> Any:
    """A JSON/TOML-ready mapping of a config dataclass (tuples become lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_mapping(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_mapping(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_mapping(v) for k, v in obj.items()}
    return obj


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def to_sparse_mapping(obj: Any, keep: Collection[str] = (), _path: str = "", _baseline: Any = None) -> dict[str, Any]:
    """A config dataclass as ``to_mapping`` writes it, less every field equal to its default (nested tables and
    lists of tables too): ``from_mapping`` reads it back equal. A ``dependent`` field's default is its
    ``default(siblings)``, and its table leaves out what equals that value's fields. ``keep`` names fields written
    whatever their value, by dotted path ("data.partition"; a list's tables share their list's name, "runs.rounds")."""
    out: dict[str, Any] = {}
    init = [f for f in dataclasses.fields(obj) if f.init]
    for f in init:
        path = f"{_path}{f.name}"
        value = getattr(obj, f.name)
        dep = _dependent_of(f)
        if _baseline is not None:
            default = getattr(_baseline, f.name)
        elif dep is not None:
            default = dep.default({g.name: getattr(obj, g.name) for g in init if g is not f})
        else:
            default = _default_of(f)
        kept = path in keep or any(k.startswith(f"{path}.") for k in keep)
        if default is not dataclasses.MISSING and not kept and type(value) is type(default) and value == default:
            continue
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            # A dependent field's parser fills what its table leaves out from its default's fields.
            baseline = default if dep is not None and type(default) is type(value) else None
            out[f.name] = to_sparse_mapping(value, keep, f"{path}.", baseline)
        elif isinstance(value, (list, tuple)) and any(dataclasses.is_dataclass(v) for v in value):
            out[f.name] = [to_sparse_mapping(v, keep, f"{path}.") if dataclasses.is_dataclass(v) else to_mapping(v)
                           for v in value]
        else:
            out[f.name] = to_mapping(value)
    return out


def load_file(cls: type[T], path: str | Path) -> T:
    """Load a ``.toml`` or ``.json`` config file into dataclass ``cls``."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc.strerror}") from exc
    try:
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{p}: not valid {'JSON' if p.suffix == '.json' else 'TOML'}: {exc}") from exc
    return from_mapping(cls, data, where=p.name)


def check(condition: bool, message: str) -> None:
    """Raise ConfigError(message) unless condition holds (for ``__post_init__`` range checks)."""
    if not condition:
        raise ConfigError(message)
