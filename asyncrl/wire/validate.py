"""Checking a received map against a message dataclass: pure, raises only :class:`WireError`.

There is no second list of fields: each dataclass field's type hint picks its check, once per class
(:class:`Schema`), and a field with a default may be absent. Errors name the field by its path
in the message (``register.generators[1].url``), so a service can say what it refused.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any

from asyncrl.wire.messages import MAX_ITEMS, MAX_STR, Bounds, WireError

MISSING = object()
_STR = {str}

Check = Callable[[Any, str, str], Any]
"""``check(value, where, key)``: the value to store in the dataclass, or a :class:`WireError`."""


def _type_name(t: type | tuple) -> str:
    if isinstance(t, tuple):
        return " or ".join(x.__name__ for x in t)
    return t.__name__


def typed(v: Any, types: type | tuple, where: str, key: str) -> Any:
    """``v`` if it is of ``types`` (a bool is not an int) and within the size limits."""
    t = type(v)
    if t is types and not (
        (t is str and len(v) > MAX_STR) or (t is list and len(v) > MAX_ITEMS)
    ):  # the common case, checked first: it runs for every field of every message
        return v
    if isinstance(v, bool) and types in (int, float, (int, float)):
        raise WireError(f"{where}.{key}: expected {_type_name(types)}, got bool")
    if not isinstance(v, types):
        raise WireError(f"{where}.{key}: expected {_type_name(types)}, got {type(v).__name__}")
    if isinstance(v, str) and len(v) > MAX_STR:
        raise WireError(f"{where}.{key}: string of {len(v)} chars, over the {MAX_STR} limit")
    if isinstance(v, list) and len(v) > MAX_ITEMS:
        raise WireError(f"{where}.{key}: {len(v)} items, over the {MAX_ITEMS} limit")
    return v


def required(d: dict, key: str, types: type | tuple, where: str) -> Any:
    """``d[key]``, which must be present and of ``types``."""
    v = d.get(key, MISSING)
    if v is MISSING:
        raise WireError(f"{where}: missing field '{key}'")
    return typed(v, types, where, key)


def bounded(v: Any, where: str, key: str, lo: int, hi: int) -> int:
    """An int (not a bool) in ``[lo, hi]``."""
    v = typed(v, int, where, key)
    if not lo <= v <= hi:
        raise WireError(f"{where}.{key}: {v} is outside [{lo}, {hi}]")
    return v


def finite(v: Any, where: str, key: str) -> float:
    """An int or float (not a bool) that is finite, as a float."""
    v = float(typed(v, (int, float), where, key))
    if not math.isfinite(v):
        raise WireError(f"{where}.{key}: must be finite, got {v}")
    return v


def str_list(v: Any, where: str, key: str) -> list[str]:
    v = typed(v, list, where, key)
    if set(map(type, v)) <= {str}:
        return v
    for i, x in enumerate(v):
        if not isinstance(x, str):
            raise WireError(f"{where}.{key}[{i}]: expected str, got {type(x).__name__}")
    return v  # pragma: no cover - a subclass of str


def str_map(v: Any, where: str, key: str) -> dict[str, str]:
    v = typed(v, dict, where, key)
    for k, x in v.items():
        if not isinstance(k, str) or not isinstance(x, str):
            raise WireError(f"{where}.{key}: expected a map of strings to strings")
    return v


def str_keyed(v: Any, where: str, key: str) -> dict[str, Any]:
    """A map whose keys are strings (msgpack also allows bytes); the values are anything."""
    if type(v) is dict and (not v or set(map(type, v)) <= _STR):
        return v
    v = typed(v, dict, where, key)
    for k in v:
        if not isinstance(k, str):
            raise WireError(f"{where}.{key}: keys must be strings")
    return v


def _check_for(hint: Any) -> Check:
    """The check a type hint calls for; only the types messages use are known. Each check passes
    the common case (the right type, within bounds) in one test, before any error handling."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        base, *extras = args
        bounds = next((x for x in extras if isinstance(x, Bounds)), None)
        if base is not int or bounds is None:
            return _check_for(base)
        lo, hi = bounds.lo, bounds.hi

        def in_bounds(v: Any, where: str, key: str) -> int:
            return v if type(v) is int and lo <= v <= hi else bounded(v, where, key, lo, hi)

        return in_bounds
    if hint is str:
        return lambda v, where, key: (
            v if type(v) is str and len(v) <= MAX_STR else typed(v, str, where, key)
        )
    if hint in (int, bool):
        return lambda v, where, key: v if type(v) is hint else typed(v, hint, where, key)
    if hint is float:
        return finite
    if origin in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        inner = _check_for(next(a for a in args if a is not type(None)))
        return lambda v, where, key: None if v is None else inner(v, where, key)
    if origin is list and args == (str,):
        return str_list
    if origin is list and dataclasses.is_dataclass(args[0]):
        item = args[0]

        def items(v: Any, where: str, key: str) -> list:
            v = typed(v, list, where, key)
            return [schema(item).build(x, f"{where}.{key}[{i}]") for i, x in enumerate(v)]

        return items
    if origin is dict and args == (str, str):
        return str_map
    if origin is dict and args[:1] == (str,):
        return str_keyed
    raise TypeError(f"no wire check for the type {hint!r}")  # a message class this does not know


Absent = Callable[[str], Any]
"""``absent(where)``: the value of a field the map does not have, or a :class:`WireError`."""


def _absent_for(f: dataclasses.Field) -> Absent:
    if f.default is not dataclasses.MISSING:
        default = f.default
        return lambda where: default
    if f.default_factory is not dataclasses.MISSING:
        factory = f.default_factory
        return lambda where: factory()

    def missing(where: str) -> Any:
        raise WireError(f"{where}: missing field '{f.name}'")

    return missing


class Schema:
    """The checks for a dataclass ``cls``, made once from its fields' type hints and defaults:
    what a received map is held to. ``skip`` names fields the caller reads another way."""

    def __init__(self, cls: type, skip: frozenset[str] = frozenset()):
        self.cls = cls
        hints = typing.get_type_hints(cls, include_extras=True)
        self.fields: tuple[tuple[str, Check, Absent], ...] = tuple(
            (f.name, _check_for(hints[f.name]), _absent_for(f))
            for f in dataclasses.fields(cls)
            if f.name not in skip
        )
        self.names = tuple(name for name, _, _ in self.fields)

    def arguments(self, d: Any, where: str) -> dict[str, Any]:
        """The checked constructor arguments from the map ``d``; ``where`` names it in errors."""
        if type(d) is not dict:
            raise WireError(f"{where}: expected a map, got {type(d).__name__}")
        out = {}
        for name, check, absent in self.fields:
            v = d.get(name, MISSING)
            out[name] = absent(where) if v is MISSING else check(v, where, name)
        return out

    def build(self, d: Any, where: str) -> Any:
        """An instance of the dataclass from the map ``d``, every field checked."""
        return self.cls(**self.arguments(d, where))


@functools.cache
def schema(cls: type) -> Schema:
    """The schema of a dataclass nested in a message (e.g. ``GeneratorInfo``), made once."""
    return Schema(cls)
