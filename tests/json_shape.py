"""The structure of a JSON value, for comparing two servers' responses without their values."""

from __future__ import annotations

from typing import Any


def json_shape(x: Any) -> Any:
    """Dict keys and value kinds, lists by their first element; ints and floats are both "number"
    (a JSON number is one kind, whichever way a server writes it)."""
    if isinstance(x, dict):
        return {k: json_shape(v) for k, v in x.items()}
    if isinstance(x, list):
        return [json_shape(x[0])] if x else []
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, int | float):
        return "number"
    return type(x).__name__
