"""A TorchTitan model spec from a HuggingFace folder: config.json mapped to TorchTitan's Qwen3 or Llama.

TorchTitan ships named flavours (``0.6B``, ``8B``...) but no mapping from an HF ``config.json``; this
module writes it with TorchTitan's own config helpers, so the model, its ``parallelize_fn`` and its
state-dict adapter (HF names in and out, tied and untied embeddings) are TorchTitan's.
"""

from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path
from typing import Any

import torch.nn as nn
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
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

log = logging.getLogger("asyncrl.learner")


class ModelConfigError(ValueError):
    """The HF folder's config.json describes a model this learner cannot build (one-line message)."""


# Weights always come from the HF folder; these inits only give ``init_weights`` something to run.
_LINEAR = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}
_NORM = {"weight": nn.init.ones_}


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
    if mtype not in ("qwen3", "llama"):
        raise ModelConfigError(
            f"{where}/config.json: model_type {mtype!r} is not supported (qwen3, llama)"
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

    if mtype == "qwen3":
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
            feed_forward=make_ffn_config(
                dim=dim, hidden_dim=hidden, w1_param_init=_LINEAR, w2w3_param_init=_LINEAR
            ),
        )
        for _ in range(n_layers)
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
        name=mtype if mtype == "qwen3" else "llama3",
        flavor=f"hf:{Path(path).name}",
        model=model,
        parallelize_fn=parallelize,
        pipelining_fn=None,
        post_optimizer_build_fn=None,
        state_dict_adapter=adapter,
    )
