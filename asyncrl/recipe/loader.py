"""From YAML to a checked :class:`Recipe` and back: each value's type and range against its
section's fields (a "did you mean" for a misspelt key), dotted overrides (``learner.lr=1e-6``),
then :func:`asyncrl.recipe.checks.validate`; :func:`dump` writes the resolved recipe as
`asyncrl check` prints it.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from asyncrl.recipe.checks import validate
from asyncrl.recipe.fields import RecipeError
from asyncrl.recipe.schema import Recipe

_SECTIONS = {f.name for f in dataclasses.fields(Recipe) if not f.metadata.get("internal")}


def _suggest(key: str, options: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _check_type(value: Any, tp: Any, key: str, file: str | None) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise RecipeError(
                f"expected one of {', '.join(map(str, choices))}, got {value!r}"
                + (_suggest(str(value), map(str, choices)) if isinstance(value, str) else ""),
                file=file,
                key=key,
            )
        return value
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise RecipeError(f"expected a list, got {type(value).__name__}", file=file, key=key)
        return [_check_type(v, item, f"{key}[{i}]", file) for i, v in enumerate(value)]
    if origin in (types.UnionType, typing.Union):
        for t in typing.get_args(tp):
            try:
                return _check_type(value, t, key, file)
            except RecipeError:
                continue
        raise RecipeError(f"expected {tp}, got {value!r}", file=file, key=key)
    if tp is bool:
        if not isinstance(value, bool):
            raise RecipeError(f"expected true or false, got {value!r}", file=file, key=key)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecipeError(f"expected an integer, got {value!r}", file=file, key=key)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RecipeError(f"expected a number, got {value!r}", file=file, key=key)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise RecipeError(f"expected a string, got {value!r}", file=file, key=key)
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key, file)
    raise RecipeError(f"unsupported type {tp}", file=file, key=key)  # pragma: no cover


def _check_range(value: Any, rng: dict, key: str, file: str | None) -> None:
    lo, hi = rng["lo"], rng["hi"]
    if lo is not None and (value < lo or (rng["lo_open"] and value == lo)):
        rel = ">" if rng["lo_open"] else ">="
        raise RecipeError(f"must be {rel} {lo}, got {value}", file=file, key=key)
    if hi is not None and value > hi:
        raise RecipeError(f"must be <= {hi}, got {value}", file=file, key=key)


def _build(cls: type, data: Any, prefix: str, file: str | None) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(
            f"expected a mapping of settings, got {type(data).__name__}", file=file, key=prefix
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in fields:
            raise RecipeError("unknown key" + _suggest(str(k), fields), file=file, key=key)
        value = _check_type(v, hints[k], key, file)
        if "range" in fields[k].metadata:
            _check_range(value, fields[k].metadata["range"], key, file)
        kwargs[k] = value
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``learner.lr=1e-6`` -> (["learner", "lr"], 1e-6). Values are read as YAML scalars."""
    if "=" not in text:
        raise RecipeError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise RecipeError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str):
        try:  # YAML 1.1 reads 1e-6 as a string; a user writing it means a number
            value = float(value)
        except ValueError:
            pass
    return parts, value


def _apply_override(data: dict, parts: list[str], value: Any) -> None:
    node = data
    for p in parts[:-1]:
        child = node.get(p)
        if child is None:
            child = node[p] = {}
        if not isinstance(child, dict):
            raise RecipeError(f"cannot set {'.'.join(parts)}: '{p}' is not a section")
        node = child
    node[parts[-1]] = value


def from_dict(
    data: dict,
    *,
    file: str | None = None,
    overrides: typing.Sequence[str] = (),
    check_files: bool = True,
) -> Recipe:
    data = dict(data or {})
    for text in overrides:
        parts, value = parse_override(text)
        if parts[0] not in _SECTIONS:
            raise RecipeError(
                "unknown section" + _suggest(parts[0], _SECTIONS),
                file="override",
                key=".".join(parts),
            )
        _apply_override(data, parts, value)
    recipe = _build(Recipe, data, "", file)
    if file:
        recipe.base_dir = str(Path(file).resolve().parent)
    validate(recipe, file=file, check_files=check_files)
    return recipe


def load(
    path: str | os.PathLike, overrides: typing.Sequence[str] = (), *, check_files: bool = True
) -> Recipe:
    """Read a YAML recipe, apply dotted overrides, validate, and return the typed recipe.

    ``check_files=False`` skips the checks that model, data and TLS files exist (for a recipe written
    for another machine, or whose model a previous stage builds); everything else is still checked.
    """
    file = str(path)
    try:
        text = Path(file).read_text()
    except FileNotFoundError:
        raise RecipeError("recipe file not found", file=file) from None
    except OSError as e:
        raise RecipeError(f"cannot read recipe: {e.strerror}", file=file) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise RecipeError(f"not valid YAML{at}", file=file) from None
    if data is not None and not isinstance(data, dict):
        raise RecipeError("a recipe must be a mapping of sections", file=file)
    return from_dict(data or {}, file=file, overrides=overrides, check_files=check_files)


def dump(recipe: Recipe) -> str:
    """The resolved recipe as YAML, as `asyncrl check` prints it."""
    return yaml.safe_dump(recipe.to_dict(), sort_keys=False)
