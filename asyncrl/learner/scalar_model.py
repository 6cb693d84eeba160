"""A backbone with a scalar head: the learner's TorchTitan decoder whose output projection is
``Linear(dim, 1)``, so the model gives one value per token.

A reward model's score is the value at a sequence's last token (Bradley–Terry training,
:mod:`asyncrl.learner.reward_model`); a PPO critic reads every token's. Building it as the decoder's
own ``lm_head`` (untied, one output) keeps TorchTitan's FSDP wrapping, checkpoints and chunked
forward unchanged. On the HF side the head is ``score.weight`` of a ``*ForSequenceClassification``
folder with one label, which transformers and SGLang load as a reward model.

Initialised from a causal-LM folder (the actor's: its backbone, a fresh head) or from a
sequence-classification folder (backbone and head).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torchtitan.models.common import Linear
from torchtitan.protocols.model_spec import ModelSpec

from asyncrl.learner.model_spec import ModelConfigError, build_spec, read_hf_config

HEAD = "lm_head.weight"
"""The head's name in the TorchTitan model (the decoder's output projection, one output)."""
HF_HEAD = "score.weight"
"""The head's name in an HF sequence-classification folder."""
HF_BIAS = "score.bias"
"""Written as zero in exports, read never. SGLang 0.5.23 builds Qwen3ForSequenceClassification's head
as ``nn.Linear(hidden, num_labels)`` *with* a bias that no HF checkpoint holds, so without it its
scores carry a random offset, different at each server start (measured +0.0789 on every input of a
tiny model; tests/sglang/test_classify.py). transformers ignores the key (its head has none)."""
SEQ_CLS_ARCH = {
    "qwen3": "Qwen3ForSequenceClassification",
    "llama": "LlamaForSequenceClassification",
}

HEAD_STD = 1e-3
"""A fresh head starts near 0: the first scores neither saturate the sigmoid nor favour a side."""
_HEAD_INIT = {"weight": partial(nn.init.normal_, std=HEAD_STD)}  # then init_head, from the seed
_EMB_INIT = {"weight": partial(nn.init.normal_, std=0.02)}


def is_seq_cls(cfg: dict[str, Any]) -> bool:
    """Does this config.json describe a sequence-classification (scalar head) model?"""
    return any(a.endswith("ForSequenceClassification") for a in cfg.get("architectures") or [])


def scalar_spec(path: str | Path, *, attention: str = "auto", max_seq_len: int = 0) -> ModelSpec:
    """The TorchTitan spec of ``path``'s backbone with a one-output, untied head.

    Its state-dict adapter reads ``score.weight`` from a sequence-classification folder and leaves
    the head at its fresh initialisation for a causal-LM folder (whose lm_head is not this head)."""
    cfg = read_hf_config(path)
    head_in_folder = is_seq_cls(cfg)
    if head_in_folder and int(cfg.get("num_labels", len(cfg.get("id2label") or {0: 0}))) != 1:
        raise ModelConfigError(
            f"{path}/config.json: a reward model / critic has one output (num_labels 1), "
            f"got {cfg.get('num_labels')}"
        )
    spec = build_spec(path, attention=attention, max_seq_len=max_seq_len)
    m = spec.model
    m.lm_head = Linear.Config(in_features=m.dim, out_features=1, param_init=_HEAD_INIT)
    if m.enable_weight_tying:  # the embedding keeps its values, loaded like any other weight
        m.enable_weight_tying = False
        m.tok_embeddings.param_init = _EMB_INIT
    spec.state_dict_adapter = scalar_adapter(spec.state_dict_adapter, head_in_folder)
    spec.parallelize_fn = partial(_parallelize_replicating_head, base=spec.parallelize_fn)
    spec.flavor = f"scalar:{Path(path).name}"
    return spec


def _parallelize_replicating_head(model: nn.Module, *, base: Any, **kw: Any) -> nn.Module:
    """The backbone's ``parallelize_fn`` with the one-output head replicated over a tensor-parallel
    group: TorchTitan's plan shards the output projection over its outputs, and one output does not
    split (DTensor then computes a replicated output the plan refuses)."""
    import spmd_types as spmd
    from torchtitan.models.common.decoder_sharding import (
        dense_activation_placement,
        dense_param_placement,
    )
    from torchtitan.protocols.sharding import ShardingConfig

    act = dense_activation_placement(tp=spmd.R)
    model.lm_head._sharding_config = ShardingConfig(
        state_shardings={"weight": dense_param_placement(tp=spmd.R)},
        in_src_shardings={"input": act},
        in_dst_shardings={"input": act},
        out_src_shardings=act,
        out_dst_shardings=act,
    )
    return base(model, **kw)


def token_values(
    model: nn.Module,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    doc_lengths: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """The head's value at every token of packed rows ``[1, L]`` (positions restart at 0 at each
    sequence; ``doc_lengths``: their lengths, from ``pack()``, so that the attention reads none
    back from the device): ``[L]`` float32. A sequence's reward score is its last token's; a
    critic's values are all of them. Collective under FSDP (every rank calls it)."""
    from torch.distributed.tensor import DTensor

    from asyncrl.learner.attention import attention_masks
    from asyncrl.learner.logprobs import local_hidden

    h = local_hidden(model(tokens, positions, attention_masks(model, positions, doc_lengths)))
    v = model.lm_head(h[0])
    if isinstance(v, DTensor):  # tensor-parallel: replicated over the group
        v = v.to_local()
    return v.squeeze(-1).float()


@torch.no_grad()
def init_head(model: nn.Module, seed: int, std: float = HEAD_STD) -> None:
    """A fresh head from ``seed`` alone: the same on every rank and in every run with that seed (the
    model's own init draws from whatever state the RNG is in, which differs between a one-rank and
    a torchrun start). Sharded or not."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    w = model.lm_head.weight
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(tuple(w.shape), generator=g, dtype=torch.float32).mul_(std).to(w.dtype)
    if isinstance(w, DTensor):
        full = distribute_tensor(full.to(w.device), w.device_mesh, w.placements)
    w.copy_(full)


def scalar_adapter(base: type, head_in_folder: bool) -> type:
    """``base`` (TorchTitan's HF adapter of the backbone) with the head named ``score.weight``.

    ``include_head`` says whether ``to_hf`` asks for the head: false for the first load from a
    causal-LM folder (it has none), true once loaded (exports and broadcasts carry it)."""

    class ScalarStateDictAdapter(base):  # type: ignore[valid-type, misc]
        include_head = head_in_folder
        include_bias = False  # exports: see HF_BIAS

        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, **kw)
            m = self.fqn_to_index_mapping
            if m:  # a sharded source folder: the head goes to its last file
                last = max(m.values())
                m.setdefault(HF_HEAD, last)
                m.setdefault(HF_BIAS, last)

        def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
            body = {k: v for k, v in state_dict.items() if k != HEAD}
            out = super().to_hf(body)
            if HEAD in state_dict and self.include_head:
                head = state_dict[HEAD]
                out[HF_HEAD] = head
                if self.include_bias:
                    out[HF_BIAS] = torch.zeros(1, dtype=head.dtype, device=head.device)
            return out

        def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
            hf = dict(hf_state_dict)
            hf.pop(HF_BIAS, None)
            head = hf.pop(HF_HEAD, None)
            hf.pop("lm_head.weight", None)  # a causal LM's projection is not this head
            out = super().from_hf(hf)
            out.pop(HEAD, None)
            if head is not None:
                out[HEAD] = head
            return out

    return ScalarStateDictAdapter


def seq_cls_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A causal-LM (or sequence-classification) config.json as the export's: one label, the
    ``*ForSequenceClassification`` architecture, untied, and a pad token (transformers finds the
    last token of each row of a padded batch by it)."""
    mtype = cfg.get("model_type", "")
    if mtype not in SEQ_CLS_ARCH:
        raise ModelConfigError(f"model_type {mtype!r} has no sequence-classification export")
    out = dict(cfg)
    out["architectures"] = [SEQ_CLS_ARCH[mtype]]
    out["num_labels"] = 1
    out["id2label"] = {"0": "LABEL_0"}  # SGLang: a classification head, so no L2 normalisation
    out["label2id"] = {"LABEL_0": 0}
    out["tie_word_embeddings"] = False
    if out.get("pad_token_id") is None:
        eos = out.get("eos_token_id")
        out["pad_token_id"] = eos[0] if isinstance(eos, list) else eos
    return out


def write_seq_cls_config(folder: str | Path) -> None:
    """Make an HF folder written with a causal LM's config.json a sequence-classification one:
    rewrite its config.json (:func:`seq_cls_config`) and drop the generation config, which a
    classifier has no use for."""
    folder = Path(folder)
    p = folder / "config.json"
    p.write_text(json.dumps(seq_cls_config(json.loads(p.read_text())), indent=2))
    (folder / "generation_config.json").unlink(missing_ok=True)
