"""User code by import path (``module:attr``): workflows, tools and rewards named in the recipe.

One loader, so every plug-in point reports a mistake the same way: one line naming the recipe key.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any


class PluginError(ValueError):
    """A recipe names user code that cannot be loaded; ``str(e)`` is one line naming the key."""


def load_object(spec: str, *, key: str, builtins: dict[str, Any] | None = None) -> Any:
    """``name`` from ``builtins``, or ``module.path:attr`` (``attr`` may be dotted).

    The current directory is importable, as when running ``python -m``, so a recipe can name a
    module that sits next to it.
    """
    builtins = builtins or {}
    if spec in builtins:
        return builtins[spec]
    if ":" not in spec:
        choices = ", ".join(builtins) + (", " if builtins else "")
        raise PluginError(
            f"{key}: {spec!r} is not one of {choices}or an import path like 'my_module:my_function'"
        )
    module_name, _, attr = spec.partition(":")
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.append(cwd)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise PluginError(f"{key}: cannot import module {module_name!r} ({e})") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginError(f"{key}: module {module_name!r} has no {attr!r}") from None
    return obj
