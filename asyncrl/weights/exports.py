"""The learner's HF exports on disk: which one is the newest, and which version it holds.

One function answers "the newest export" for everyone who needs it: the launcher (the model it
evaluates and links as ``hf/latest``), the broadcaster (a rejoining generator loads it) and a
(re)started rollout worker (its built-in engines start from it). No torch here: the launcher
imports it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

VERSION_FILE = "asyncrl_version.json"
"""Written next to an exported HF checkpoint: ``{"version": v}`` (else the folder name's last number)."""
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""A PEFT adapter folder (``learner.lora.export: adapter``): these two, no config.json; its base is
the config's ``base_model_name_or_path``."""


def is_adapter_export(d: str | Path) -> bool:
    """Whether ``d`` is a LoRA adapter export (PEFT's files) rather than a whole HF model."""
    d = Path(d)
    return (d / ADAPTER_CONFIG).is_file() and (d / ADAPTER_WEIGHTS).is_file()


def is_export(d: Path) -> bool:
    """An HF model folder (config.json and safetensors) or an adapter export."""
    return is_adapter_export(d) or ((d / "config.json").is_file() and any(d.glob("*.safetensors")))


def latest_export(
    export_dir: str | Path | None, *, at_most: int | None = None
) -> tuple[Path, int] | None:
    """The newest HF checkpoint folder under ``export_dir`` (itself or a subfolder with config.json
    and safetensors, or a LoRA adapter export: :func:`is_adapter_export`) and its version; None if
    there is none.

    ``at_most``: only versions up to this one. A learner resumed from a checkpoint at version c
    leaves the exports of the run it lost (versions above c) on disk until it overwrites them; only
    exports up to the version it has announced are its own.
    """
    if export_dir is None:
        return None
    root = Path(export_dir)
    if not root.is_dir():
        return None
    best: tuple[Path, int] | None = None
    for d in [root, *sorted(p for p in root.iterdir() if p.is_dir())]:
        if not is_export(d):
            continue
        v = export_version(d)
        if v is None or (at_most is not None and v > at_most):
            continue
        if best is None or v > best[1]:
            best = (d, v)
    return best


def export_version(d: Path) -> int | None:
    """The version an export folder holds: its VERSION_FILE, else its name's last number (``v12``)."""
    f = d / VERSION_FILE
    if f.is_file():
        try:
            return int(json.loads(f.read_text())["version"])
        except (ValueError, KeyError, TypeError):
            return None
    m = re.search(r"(\d+)$", d.name)
    return int(m.group(1)) if m else None
