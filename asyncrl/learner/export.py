"""The actor's weights out of the learner: as full tensors under HF names (what the weight
broadcaster sends), and as an HF folder that transformers and SGLang load (safetensors, config and
tokenizer files).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

HF_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
"""Files copied from the source HF folder into every export, next to the weights."""


def hf_state_dict(
    model: torch.nn.Module | None,
    adapter: Any,
    dtype: torch.dtype | None = None,
    *,
    keep: bool = True,
) -> dict[str, torch.Tensor]:
    """Fresh full tensors under HF names (collective over the model's ranks; ``model`` None on a
    rank without it: ``{}``).

    One tensor is gathered at a time, cast to ``dtype`` first (a bfloat16 broadcast gathers
    bfloat16). With ``keep=False`` this rank gathers and drops them: only the sender needs a second
    copy of the model (8B in float32 would be 32 GB per rank)."""
    out: dict[str, torch.Tensor] = {}
    if model is None:
        return out
    for k, p in adapter.to_hf(model.state_dict()).items():
        v = p.detach()
        if dtype is not None and v.is_floating_point() and v.dtype != dtype:
            v = v.to(dtype)
        t = v.full_tensor() if isinstance(v, DTensor) else v
        if keep:
            live = p.to_local() if isinstance(p, DTensor) else p
            aliased = t.untyped_storage().data_ptr() == live.untyped_storage().data_ptr()
            out[k] = t.clone() if aliased else t
    return out


def export_hf(
    model: torch.nn.Module | None,
    checkpointer: Any,
    path: str | Path,
    *,
    dtype: str,
    source: Path,
    rank: int,
) -> Path:
    """Write an HF folder (safetensors, config.json, tokenizer files) loadable by transformers.

    Collective. Weights go through DCP's HuggingFace writer and the state-dict adapter (TorchTitan's
    ``checkpointer``), so no rank holds the whole model; rank 0 then adds config and tokenizer files
    from the ``source`` HF folder."""
    from torchtitan.components.checkpoint import AsyncMode, ModelWrapper
    from torchtitan.config import TORCH_DTYPE_MAP

    path = Path(path).resolve()
    tdtype = TORCH_DTYPE_MAP[dtype]
    if rank == 0:
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
    dist.barrier()
    states = {
        k: v.to(tdtype) if v.is_floating_point() and v.dtype != tdtype else v
        for k, v in ModelWrapper([model] if model is not None else []).state_dict().items()
    }
    checkpointer.dcp_save(
        states, checkpoint_id=str(path), async_mode=AsyncMode.DISABLED, to_hf=True
    )
    if rank == 0:
        for name in HF_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, path / name)
        cfg = json.loads((path / "config.json").read_text())
        cfg["dtype"] = cfg["torch_dtype"] = dtype
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
        shutil.rmtree(path / "sharded", ignore_errors=True)
    dist.barrier()
    return path
