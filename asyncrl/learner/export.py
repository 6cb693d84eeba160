"""The actor's weights out of the learner: as full tensors under HF names (what the weight
broadcaster sends), and as an HF folder that transformers and SGLang load (safetensors, config and
tokenizer files). With ``learner.lora``: a PEFT adapter folder, or an HF folder with the adapters
merged into the weights (:func:`export_adapter`, ``merge`` of :func:`export_hf`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from asyncrl.learner import lora as adapters
from asyncrl.recipe import LoraConfig
from asyncrl.weights.exports import peft_config, write_adapter_export

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
TOKENIZER_FILES = tuple(f for f in HF_FILES if f not in ("config.json", "generation_config.json"))
"""What an adapter export copies: a config.json would make transformers read the folder as a whole
model instead of loading ``base_model_name_or_path`` and the adapter on it."""


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
    base = {k: v for k, v in model.state_dict().items() if not adapters.is_adapter(k)}
    experts = {k for k, v in base.items() if isinstance(v, DTensor) and GROUPED_EXPERTS in k}
    for k, p in adapter.to_hf({k: v for k, v in base.items() if k not in experts}).items():
        v = p.detach()
        if dtype is not None and v.is_floating_point() and v.dtype != dtype:
            v = v.to(dtype)
        t = v.full_tensor() if isinstance(v, DTensor) else v
        if keep:
            live = p.to_local() if isinstance(p, DTensor) else p
            aliased = t.untyped_storage().data_ptr() == live.untyped_storage().data_ptr()
            out[k] = t.clone() if aliased else t
    for k in sorted(experts):  # the same order on every rank: each is a collective
        v = base[k].detach()
        if dtype is not None and v.dtype != dtype:
            v = v.to(dtype)
        # gathered first: the adapter then splits all the layer's experts (its plain-tensor path)
        # into views of the gathered tensor, which on one rank may be the parameter itself
        t = v.full_tensor()
        if keep:
            aliased = (
                t.untyped_storage().data_ptr() == base[k].to_local().untyped_storage().data_ptr()
            )
            out |= adapter.to_hf({k: t.clone() if aliased else t})
    return out


GROUPED_EXPERTS = ".moe.routed_experts.inner_experts."
"""In a TorchTitan MoE layer's parameter names: one tensor holding every expert of the layer
(``[experts, ...]``). TorchTitan's state-dict adapter maps a sharded one (a DTensor) to HF names
for this rank's experts alone (``_get_local_experts_weights``: for DCP, where each rank writes its
own), so under FSDP a rank would name only its shard's experts; :func:`hf_state_dict` gathers the
tensor before the adapter splits it, so that every expert comes out under its HF name."""


def export_hf(
    model: torch.nn.Module | None,
    checkpointer: Any,
    path: str | Path,
    *,
    dtype: str,
    source: Path,
    rank: int,
    lora: LoraConfig | None = None,
    version: int = 0,
) -> Path:
    """Write an HF folder (safetensors, config.json, tokenizer files) loadable by transformers.

    Collective. Weights go through DCP's HuggingFace writer and the state-dict adapter (TorchTitan's
    ``checkpointer``), so no rank holds the whole model; rank 0 then adds config and tokenizer files
    from the ``source`` HF folder. With ``lora`` on (the model has adapters), as its ``export``
    says: a PEFT folder (:func:`export_adapter`, which takes ``version``), or each target's weight
    written as ``W + scaling · B A`` (in the parameters' dtype, then cast) without the adapters."""
    if lora is not None and lora.enabled and lora.export == "adapter":
        return export_adapter(
            model, path, cfg=lora, dtype=dtype, source=source, rank=rank, version=version
        )
    from torchtitan.components.checkpoint import AsyncMode, ModelWrapper
    from torchtitan.config import TORCH_DTYPE_MAP

    path = Path(path).resolve()
    tdtype = TORCH_DTYPE_MAP[dtype]
    if rank == 0:
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
    dist.barrier()
    states = ModelWrapper([model] if model is not None else []).state_dict()
    if lora is not None and lora.enabled:
        states = adapters.merge(states, adapters.adapter_state_dict(model), lora.scaling)
    states = {
        k: v.to(tdtype) if v.is_floating_point() and v.dtype != tdtype else v
        for k, v in states.items()
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


def export_adapter(
    model: torch.nn.Module | None,
    path: str | Path,
    *,
    cfg: LoraConfig,
    dtype: str,
    source: Path,
    rank: int,
    version: int,
) -> Path:
    """Write a PEFT adapter folder: ``adapter_config.json``, ``adapter_model.safetensors`` (PEFT's
    ``save_pretrained`` names), the tokenizer files and :data:`VERSION_FILE`. transformers + PEFT
    load it onto ``source``, the base (``base_model_name_or_path``). Collective: the adapters are
    gathered over the actor's ranks, rank 0 writes."""
    from torchtitan.config import TORCH_DTYPE_MAP

    path = Path(path).resolve()
    tensors = adapters.adapter_state_dict(model, TORCH_DTYPE_MAP[dtype], keep=rank == 0)
    if rank == 0:
        write_adapter_export(
            tensors,
            path,
            config=peft_config(cfg, str(source.resolve())),
            version=version,
            files=[source / n for n in TOKENIZER_FILES if (source / n).is_file()],
        )
    dist.barrier()
    return path
