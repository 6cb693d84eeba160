"""What an HF config.json says about a mixture of experts: which model types are one, which layers
are sparse, how many experts each has (pure, no I/O; docs/moe.md). The recipe's checks, the
learner's model, the memory plan and the rollout's routes all read a config by these rules, so
they agree on which layers a route's rows are."""

from __future__ import annotations

MOE_MODEL_TYPES = ("qwen3_moe",)
"""The mixture-of-experts model types the learner builds (docs/moe.md)."""


def moe_layers(cfg: dict) -> list[bool]:
    """Which layers of an HF Qwen3-MoE config are MoE: transformers' rule (a layer is sparse unless
    listed in ``mlp_only_layers``, every ``decoder_sparse_step``-th one)."""
    n = int(cfg.get("num_hidden_layers", 0))
    if cfg.get("model_type") not in MOE_MODEL_TYPES:
        return [False] * n
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    return [i not in dense and (i + 1) % step == 0 for i in range(n)]


def num_experts(cfg: dict) -> int:
    """The experts per MoE layer (Qwen3-MoE's hub configs say ``num_experts``; transformers 5
    writes ``num_local_experts``); 0 for a dense model."""
    if cfg.get("model_type") not in MOE_MODEL_TYPES:
        return 0
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
