"""The learner's HF exports on disk: which one is the newest, and which version it holds.

One function answers "the newest export" for everyone who needs it: the launcher (the model it
evaluates and links as ``hf/latest``), the broadcaster (a rejoining generator loads it) and a
(re)started rollout worker (its built-in engines start from it). No torch here: the launcher
imports it.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from asyncrl.recipe import LoraConfig

VERSION_FILE = "asyncrl_version.json"
"""Written next to an exported HF checkpoint: ``{"version": v}`` (else the folder name's last number)."""
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""A PEFT adapter folder (``learner.lora.export: adapter``): these two, no config.json; its base is
the config's ``base_model_name_or_path``."""
PEFT_PREFIX = "base_model.model."
"""What PEFT's ``save_pretrained`` puts before a LoRA model's module path: the wire name
``model.layers.0.self_attn.q_proj.lora_A.weight`` is ``base_model.model.`` + it in the folder."""


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


def peft_config(lora: LoraConfig, base: str = "") -> dict:
    """The ``adapter_config.json`` of the recipe's adapters, as PEFT writes it for a LoRA model
    (``base``: the base model's folder, ``base_model_name_or_path``; empty where the reader knows
    its base, as an SGLang server does)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base or None,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def write_adapter_export(
    tensors: Mapping[str, torch.Tensor],
    folder: str | Path,
    *,
    config: dict,
    version: int,
    files: Iterable[Path] = (),
) -> Path:
    """A PEFT adapter folder: ``tensors`` (wire names) as ``adapter_model.safetensors`` under PEFT's
    names, ``config`` (:func:`peft_config`) as ``adapter_config.json``, :data:`VERSION_FILE`, and a
    copy of each of ``files`` (tokenizer files). Written under a temporary name, then renamed: a
    reader (an SGLang server, a restarting worker) never sees half a folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    named = {PEFT_PREFIX + n: t.detach().contiguous().cpu() for n, t in tensors.items()}
    save_file(named, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    (tmp / VERSION_FILE).write_text(json.dumps({"version": version}))
    for f in files:
        shutil.copy2(f, tmp / f.name)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder
