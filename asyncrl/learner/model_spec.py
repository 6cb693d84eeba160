"""A TorchTitan model spec from a HuggingFace folder: config.json mapped to TorchTitan's Qwen3 (dense
or MoE) or Llama.

TorchTitan ships named flavours (``0.6B``, ``8B``...) but no mapping from an HF ``config.json``; this
module writes it with TorchTitan's own config helpers, so the model, its ``parallelize_fn`` and its
state-dict adapter (HF names in and out, tied and untied embeddings) are TorchTitan's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.config_utils import (
    make_ffn_config,
    make_gqa_config,
    make_moe_config,
    make_routed_experts_config,
    make_router_config,
)
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.common.param_init import skip_param_init
from torchtitan.models.llama3 import Llama3Model, parallelize_llama
from torchtitan.models.llama3.model import Llama3TransformerBlock
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.models.qwen3 import Qwen3Model, parallelize_qwen3
from torchtitan.models.qwen3.model import Qwen3TransformerBlock
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.protocols.model_spec import ModelSpec

from asyncrl.learner import cpu_shims
from asyncrl.learner.attention import choose_attention, inner_attention_config, module_importable
from asyncrl.learner.routing import ReplayRouter
from asyncrl.recipe.moe_config import moe_layers, num_experts

log = logging.getLogger("asyncrl.learner")


class ModelConfigError(ValueError):
    """The HF folder's config.json describes a model this learner cannot build (one-line message)."""


# Weights always come from the HF folder; these inits only give ``init_weights`` something to run.
_LINEAR = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}
_NORM = {"weight": nn.init.ones_}


class Experts(GroupedExperts):
    """TorchTitan's grouped experts, computed in the weights' dtype where they are not bfloat16.

    TorchTitan's ``GroupedExperts`` casts inputs and weights to bfloat16 for ``torch._grouped_mm``
    whatever the model's dtype, so a float32 learner's MoE layers would round at bfloat16 and its
    log-probabilities would differ from the float32 generator's by far more than float noise. In
    bfloat16 on a GPU the experts run TorchTitan's grouped GEMM unchanged; otherwise one matmul per
    expert over its contiguous slice of the dispatched tokens (``torch._grouped_mm``'s float32
    backward fails on CPU in torch 2.13: "Invalid strides/sizes")."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (
            w.to_local() if isinstance(w, DTensor) else w
            for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD)
        )
        if w1.dtype == torch.bfloat16 and w1.device.type == "cuda":
            return super().forward(x_RD, num_tokens_per_expert_E)
        x = x_RD.to(w1.dtype)
        outs, start = [], 0
        for e, n in enumerate(num_tokens_per_expert_E.tolist()):
            xe = x[start : start + int(n)]
            start += int(n)
            outs.append((F.silu(xe @ w1[e].T) * (xe @ w3[e].T)) @ w2[e].T)
        return torch.cat(outs).type_as(x_RD) if outs else x_RD[:0]


def read_hf_config(path: str | Path) -> dict[str, Any]:
    p = Path(path) / "config.json"
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise ModelConfigError(f"{p}: not found (model.path must be an HF model folder)") from None
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from None


def _rope_params(cfg: dict) -> dict:
    rp = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rp.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rp.setdefault("rope_type", rp.get("type", "default"))
    return rp


def _need(cfg: dict, key: str, where: str) -> Any:
    if key not in cfg:
        raise ModelConfigError(f"{where}/config.json: missing {key!r}")
    return cfg[key]


def build_spec(path: str | Path, *, attention: str = "auto", max_seq_len: int = 0) -> ModelSpec:
    """The TorchTitan ``ModelSpec`` (config, parallelize_fn, state-dict adapter) of an HF folder.

    ``max_seq_len`` bounds the RoPE cache (0: the model's ``max_position_embeddings``).
    """
    cfg = read_hf_config(path)
    where = str(path)
    mtype = cfg.get("model_type", "")
    if mtype not in ("qwen3", "qwen3_moe", "llama"):
        raise ModelConfigError(
            f"{where}/config.json: model_type {mtype!r} is not supported (qwen3, qwen3_moe, llama)"
        )
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ModelConfigError(f"{where}/config.json: attention_bias/mlp_bias are not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"{where}/config.json: hidden_act must be silu")
    dim = _need(cfg, "hidden_size", where)
    n_heads = _need(cfg, "num_attention_heads", where)
    n_kv = cfg.get("num_key_value_heads") or n_heads
    head_dim = cfg.get("head_dim") or dim // n_heads
    n_layers = _need(cfg, "num_hidden_layers", where)
    hidden = _need(cfg, "intermediate_size", where)
    vocab = _need(cfg, "vocab_size", where)
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    tie = bool(cfg.get("tie_word_embeddings", False))
    seq = int(max_seq_len or cfg.get("max_position_embeddings", 4096))
    rp = _rope_params(cfg)
    if cpu_shims.ON_CPU and attention in ("flex", "varlen"):
        raise ModelConfigError(
            f"model.attention: {attention} cannot train on CPU (no CPU backward / kernel); "
            "use auto or sdpa"
        )
    capability = None
    if not cpu_shims.ON_CPU:
        import torch

        capability = torch.cuda.get_device_capability()
    try:
        chosen, why = choose_attention(
            attention,
            on_cpu=cpu_shims.ON_CPU,
            capability=capability,
            importable=module_importable,
        )
    except ValueError as e:
        raise ModelConfigError(str(e)) from None
    log.info("attention: %s", why)
    inner = inner_attention_config(chosen)

    def norm(n: int) -> RMSNorm.Config:
        return RMSNorm.Config(normalized_shape=n, eps=eps, param_init=_NORM)

    if mtype in ("qwen3", "qwen3_moe"):
        if rp["rope_type"] not in ("default", "yarn"):
            raise ModelConfigError(f"{where}/config.json: rope_type {rp['rope_type']!r}")
        rope_kw: dict[str, Any] = {}
        if rp["rope_type"] == "yarn":
            rope_kw = dict(
                scaling="yarn",
                rope_factor=float(rp.get("factor", 1.0)),
                beta_fast=float(rp.get("beta_fast", 32.0)),
                beta_slow=float(rp.get("beta_slow", 1.0)),
                original_seq_len=int(rp.get("original_max_position_embeddings", 4096)),
                truncate=bool(rp.get("truncate", True)),
            )
        rope = CosSinRoPE.Config(
            dim=head_dim, max_seq_len=seq, theta=float(rp["rope_theta"]), **rope_kw
        )
        block_cls, model_cls = Qwen3TransformerBlock, Qwen3Model
        qk_norm: RMSNorm.Config | None = norm(head_dim)
        parallelize, adapter = parallelize_qwen3, Qwen3StateDictAdapter
    else:
        if rp["rope_type"] not in ("default", "llama3"):
            raise ModelConfigError(f"{where}/config.json: rope_type {rp['rope_type']!r}")
        rope_kw = {}
        if rp["rope_type"] == "llama3":
            rope_kw = dict(
                scaling="llama",
                scaling_factor=float(rp["factor"]),
                low_freq_factor=float(rp["low_freq_factor"]),
                high_freq_factor=float(rp["high_freq_factor"]),
                original_max_position_embeddings=int(rp["original_max_position_embeddings"]),
            )
        # TorchTitan's Llama uses interleaved (complex) RoPE; its adapter permutes q/k from HF.
        rope = ComplexRoPE.Config(
            dim=head_dim, max_seq_len=seq, theta=float(rp["rope_theta"]), **rope_kw
        )
        block_cls, model_cls = Llama3TransformerBlock, Llama3Model
        qk_norm = None
        parallelize, adapter = parallelize_llama, Llama3StateDictAdapter

    sparse = moe_layers(cfg)
    moe = _moe_config(cfg, where, dim) if any(sparse) else None
    layers = [
        block_cls.Config(
            attention_norm=norm(dim),
            ffn_norm=norm(dim),
            attention=make_gqa_config(
                dim=dim,
                n_heads=n_heads,
                n_kv_heads=n_kv,
                head_dim=head_dim,
                wqkv_param_init=_LINEAR,
                wo_param_init=_LINEAR,
                inner_attention=inner,
                fuse_qkv=True,
                rope=rope,
                qk_norm=qk_norm,
            ),
            **(
                {"moe": moe, "feed_forward": None}
                if sparse[i]
                else {
                    "feed_forward": make_ffn_config(
                        dim=dim, hidden_dim=hidden, w1_param_init=_LINEAR, w2w3_param_init=_LINEAR
                    )
                }
            ),
        )
        for i in range(n_layers)
    ]
    emb_init = {"weight": skip_param_init} if tie else {"weight": _LINEAR["weight"]}
    model = model_cls.Config(
        vocab_size=vocab,
        dim=dim,
        norm=norm(dim),
        enable_weight_tying=tie,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=emb_init
        ),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR),
        layers=layers,
    )
    return ModelSpec(
        name="llama3" if mtype == "llama" else "qwen3",
        flavor=f"hf:{Path(path).name}",
        model=model,
        parallelize_fn=parallelize,
        pipelining_fn=None,
        post_optimizer_build_fn=None,
        state_dict_adapter=adapter,
    )


def _moe_config(cfg: dict, where: str, dim: int) -> Any:
    """TorchTitan's MoE block for a Qwen3-MoE config: softmax router over all experts, top-k,
    renormalized when ``norm_topk_prob`` (as transformers' ``Qwen3MoeSparseMoeBlock``), no shared
    expert.

    Load balancing is off (``load_balance_coeff=None``). TorchTitan 0.3 offers one balancer, the
    auxiliary-loss-free expert bias (added to the router's scores when choosing experts, updated
    before each optimizer step), and no auxiliary loss. A Qwen3-MoE checkpoint has no place for that
    bias: the state-dict adapter drops it, so transformers, SGLang and the built-in engine would
    route without it while the learner routed with it, and π and μ would come from different
    experts."""
    e = num_experts(cfg)
    k = int(_need(cfg, "num_experts_per_tok", where))
    width = int(_need(cfg, "moe_intermediate_size", where))
    if e < 1 or not 1 <= k <= e:
        raise ModelConfigError(
            f"{where}/config.json: num_experts_per_tok {k} must be in 1..num_experts ({e})"
        )
    experts_init = {"w1_EFD": _LINEAR["weight"], "w2_EDF": _LINEAR["weight"]}
    experts_init["w3_EFD"] = _LINEAR["weight"]
    routed = make_routed_experts_config(
        dim=dim,
        hidden_dim=width,
        num_experts=e,
        top_k=k,
        param_init=experts_init,
        comm_backend="standard",
    )
    routed.inner_experts = Experts.Config(
        dim=dim, hidden_dim=width, num_experts=e, param_init=experts_init
    )
    log.info(
        "moe: %d experts, top-%d, width %d; load balancing off (TorchTitan 0.3's expert-bias update "
        "has no place in a Qwen3-MoE checkpoint, so the generator would route without it)",
        e,
        k,
        width,
    )
    router = make_router_config(
        dim=dim,
        num_experts=e,
        gate_param_init=_LINEAR,
        top_k=k,
        score_func="softmax",
        route_norm=bool(cfg.get("norm_topk_prob", False)),
    )
    # TorchTitan's router, able to take the generator's experts (routing replay: routing.py)
    replayable = ReplayRouter.Config(
        **{f.name: getattr(router, f.name) for f in dataclasses.fields(router) if f.init}
    )
    return make_moe_config(
        num_experts=e,
        router=replayable,
        routed_experts=routed,
        load_balance_coeff=None,
    )
