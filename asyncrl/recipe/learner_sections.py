"""The sections the learner reads: ``algorithm`` (the loss, the advantage, their coefficients),
``learner`` (the optimizer, the batch's split, checkpoints, LoRA), ``critic`` and ``placement``
(which ranks run each model role, in what parallel layout; the rules a layout obeys are in
:mod:`asyncrl.recipe.layout`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from asyncrl.recipe.fields import (
    OFFLINE_LOSSES,
    Advantage,
    Aggregation,
    Checkpointing,
    Loss,
    setting,
)


@dataclass(kw_only=True)
class AlgorithmConfig:
    loss: Loss = setting("decoupled_ppo")
    advantage: Advantage = setting("grpo")
    aggregation: Aggregation = setting(
        "auto",
        doc="auto: seq_mean_token_mean for gspo (its definition), seq_mean_token_sum_norm for "
        "dr_grpo (Dr. GRPO's constant-length sum), token_mean otherwise",
    )
    clip_low: float = setting(0.2, lo=0)
    clip_high: float = setting(0.28, lo=0, doc="clip-higher (DAPO) when > clip_low")
    cispo_clip_low: bool = setting(
        False,
        doc="cispo: clip the weight from below too, at 1 − clip_low (false: MiniMax-M1's CISPO, "
        "whose weight min(π/μ, 1 + clip_high) is bounded above only)",
    )
    dual_clip: bool = setting(
        False, doc="ppo, decoupled_ppo: with A < 0 cap the token loss at clip_c·|A| (verl)"
    )
    clip_c: float = setting(
        3.0, lo=1, lo_open=True, doc="the dual clip's bound (verl's clip_ratio_c)"
    )
    is_cap: float = setting(5.0, lo=0, lo_open=True, doc="C: cap on importance weights")
    m2po_tau: float = setting(
        0.04,
        lo=0,
        lo_open=True,
        doc="m2po: τ, the most mean (log π_prox − log μ)² the kept tokens may have; the largest "
        "are masked until it holds, over the whole batch on every rank (M2PO)",
    )
    prox_anchor: Literal["recompute", "staleness"] = setting(
        "recompute",
        doc="decoupled_ppo's π_prox. recompute: the weights the step starts from; staleness: "
        "A-3PO's log μ + s/(s+1)·(log π − log μ) per token of staleness s, so the clip acts at "
        "one update per batch",
    )
    ratio_mask_low: float = setting(0.0, lo=0, doc="mask tokens with ratio below this (0: off)")
    ratio_mask_high: float = setting(0.0, lo=0, doc="mask tokens with ratio above this (0: off)")
    seq_mask_low: float = setting(
        0.0,
        lo=0,
        doc="mask sequences whose geometric-mean ratio exp(mean log ρ) is below this (0: off; < 1)",
    )
    seq_mask_high: float = setting(
        0.0,
        lo=0,
        doc="mask sequences whose geometric-mean ratio exp(mean log ρ) is above this (0: off; > 1)",
    )
    is_level: Literal["token", "sequence"] = setting(
        "token",
        doc="tis, decoupled_ppo: the truncated IS weight per token, min(ρ_t, C), or per sequence, "
        "min(Π_t ρ_t, C) on each of its tokens (verl's sequence-level rollout IS)",
    )
    kl_coef: float = setting(0.0, lo=0, doc="β of the KL(π ‖ π_ref) penalty in the loss")
    kl_estimator: Literal["k1", "k2", "k3"] = setting(
        "k3",
        doc="the KL value added and logged (k3 clamped to 10); its gradient is always KL(π‖π_ref)'s",
    )
    entropy_coef: float = setting(0.0)
    adv_eps: float = setting(1e-6, lo=0, lo_open=True)
    gamma: float = setting(1.0, lo=0, hi=1, doc="gae, vtrace: discount per token")
    lam: float = setting(
        1.0, lo=0, hi=1, doc="gae, vtrace: λ, the trace's length (1: Monte Carlo, 0: one-step TD)"
    )
    vtrace_rho_bar: float = setting(
        1.0, lo=0, lo_open=True, doc="vtrace: ρ̄, truncation of π/μ in the targets' TD errors"
    )
    vtrace_c_bar: float = setting(
        1.0, lo=0, lo_open=True, doc="vtrace: c̄, truncation of π/μ in the trace (≤ ρ̄)"
    )
    value_clip: float = setting(
        0.2, lo=0, doc="ε_v: the critic's value change per step is clipped to ±ε_v (0: off)"
    )
    kl_reward_coef: float = setting(
        0.0,
        lo=0,
        doc="β of the per-token reward r_t − β·(log μ_t − log π_ref,t) (gae, vtrace; classic RLHF)",
    )
    distill_coef: float = setting(
        0.0,
        lo=0,
        doc="distill: weight of the outcome reward in A_t = log π_teacher,t − log π_prox,t + "
        "distill_coef·A_i, A_i the sample's GRPO advantage (0: the teacher alone)",
    )
    routing_replay: bool = setting(
        False,
        doc="mixture-of-experts policies: train every token with the experts the generator's "
        "router chose for it (rollout routing replay, R3; docs/moe.md); the gating weights stay "
        "the current router's, so it still learns",
    )
    moe_aux_loss_coef: float = setting(
        0.0,
        lo=0,
        doc="mixture-of-experts policies: weight of the Switch/Qwen3-MoE auxiliary "
        "load-balancing loss (transformers' router_aux_loss_coef; Qwen3-MoE's config has 0.001) "
        "added to the actor's loss, logged as loss/moe_aux (0: off; docs/moe.md)",
    )

    @property
    def uses_rollouts(self) -> bool:
        """False for the losses trained from a local data set (:data:`OFFLINE_LOSSES`)."""
        return self.loss not in OFFLINE_LOSSES

    @property
    def aggregation_used(self) -> str:
        """The aggregation the loss runs with (``auto`` resolved)."""
        if self.aggregation != "auto":
            return self.aggregation
        if self.loss == "gspo":
            return "seq_mean_token_mean"
        if self.advantage == "dr_grpo" and self.uses_rollouts:
            return "seq_mean_token_sum_norm"
        return "token_mean"


LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(kw_only=True)
class LoraConfig:
    """Low-rank adapters on the actor's linear layers (docs/lora.md): the base stays frozen, only
    the adapters train, are checkpointed and are sent to the generators. The effective weight of a
    target is W + (alpha / rank) · B A, as PEFT's LoRA (not rsLoRA)."""

    rank: int = setting(0, lo=0, doc="adapter rank r (0: no LoRA, the whole model trains)")
    alpha: float = setting(16.0, lo=0, lo_open=True, doc="the adapter's scale is alpha / rank")
    dropout: float = setting(
        0.0, lo=0, hi=0.99, doc="dropout on the adapter's input while training"
    )
    targets: list[LoraTarget] = setting(
        factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        doc="the HF linear layers that get an adapter",
    )
    export: Literal["adapter", "merged"] = setting(
        "adapter",
        doc="adapter: a PEFT folder (adapter_config.json, adapter_model.safetensors); merged: an "
        "HF folder with B A folded into the weights",
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank if self.rank else 0.0


@dataclass(kw_only=True)
class LearnerConfig:
    ranks: int = setting(1, lo=1, doc="torchrun processes started by `asyncrl run`")
    lr: float = setting(1e-6, lo=0)
    weight_decay: float = setting(0.0, lo=0)
    betas: list[float] = setting(factory=lambda: [0.9, 0.999])
    eps: float = setting(1e-8, lo=0, lo_open=True)
    warmup_steps: int = setting(0, lo=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = setting("constant")
    grad_clip: float = setting(1.0, lo=0)
    lr_ess_scale: Literal["off", "sqrt", "linear"] = setting(
        "off",
        doc="scale each update's lr by its importance weights' normalised ESS (VCPO): sqrt "
        "(VCPO's rule for Adam: ESS·N is the effective batch) or linear; on top of the schedule",
    )
    lr_ess_floor: float = setting(
        0.0, lo=0, hi=1, doc="with lr_ess_scale: the smallest factor the lr is scaled by"
    )
    micro_batch_tokens: int = setting(8192, lo=1, doc="packed tokens per forward/backward")
    minibatches: int = setting(
        1,
        lo=1,
        doc="optimizer updates per batch, each on 1/minibatches of it (AReaL's ppo_n_minibatches); "
        "> 1 recomputes π_prox before the first (decoupled_ppo's trust region needs it)",
    )
    epochs: int = setting(1, lo=1, doc="passes over each batch (each pass: `minibatches` updates)")
    activation_checkpointing: Checkpointing = setting(
        "none",
        doc="recompute each block's activations in the backward (TorchTitan's SelectiveAC / FullAC)",
    )
    compile: bool = setting(
        False, doc="torch.compile each transformer block (TorchTitan's); GPU only"
    )
    logits_chunk_mb: float = setting(
        1024.0,
        lo=0,
        lo_open=True,
        doc="MiB of float32 logits per chunk: log π is computed a chunk of tokens at a time "
        "(each chunk also reads the output projection and adds into its whole gradient, so not "
        "much smaller: 1024 is 441 tokens at vocabulary 151,936)",
    )
    batch_size: int = setting(64, lo=1, doc="sft: sequences per step")
    checkpoint_every: int = setting(
        10, lo=0, doc="DCP checkpoint every k versions (0: only at the end)"
    )
    checkpoint_async: bool = setting(True)
    export_every: int = setting(
        0, lo=0, doc="HF safetensors export every k versions (0: at the end)"
    )
    keep_checkpoints: int = setting(2, lo=0)
    lora: LoraConfig = setting(factory=LoraConfig, doc="low-rank adapters (rank 0: off)")


@dataclass(kw_only=True)
class CriticConfig:
    """The value model of ``algorithm.advantage: gae`` / ``vtrace`` (learner/critic.py): trained
    beside the actor on the same ranks, with the learner's optimizer settings but its own lr."""

    path: str = setting(
        "",
        doc="HF folder: a causal LM (its backbone, a fresh value head) or a one-label "
        "sequence-classification model such as a reward model (backbone and head); empty: model.path",
    )
    lr: float = setting(
        1e-5, lo=0, doc="the critic's AdamW learning rate (the actor's is learner.lr)"
    )


@dataclass(kw_only=True)
class RolePlacement:
    """Where one model role of the learner runs (docs/placement.md): on which learner ranks, and
    how its ranks are split between tensor parallelism and FSDP's data-parallel sharding."""

    ranks: list[int] = setting(
        factory=list, doc="learner ranks (torchrun RANK) of this role; empty: every rank"
    )
    tensor_parallel: int = setting(
        1, lo=1, doc="tensor-parallel degree inside the role's ranks (the rest shard with FSDP2)"
    )
    offload: bool = setting(
        False,
        doc="between its calls, give the role's parameters, gradients and optimizer state back "
        "(to pinned host memory on GPU; on CPU nothing is freed: a log line says so)",
    )


ROLES = ("actor", "critic", "ref")
"""The learner's model roles a recipe places (the reward model is scored by the workers)."""


@dataclass(kw_only=True)
class PlacementConfig:
    """Each learner role's ranks and parallel layout. Roles on disjoint ranks run their calls at
    once; roles on the same ranks run in the dataflow's order. The default puts every role on
    every rank, FSDP2 over all of them (data-parallel sharding only)."""

    actor: RolePlacement = setting(factory=RolePlacement)
    critic: RolePlacement = setting(factory=RolePlacement, doc="gae / vtrace's value model")
    ref: RolePlacement = setting(
        factory=RolePlacement, doc="the frozen π_ref of a KL term; empty ranks: the actor's ranks"
    )

    def ranks_of(self, role: str, world: int) -> list[int]:
        """The role's ranks in a learner of ``world`` ranks (the ref follows the actor)."""
        ranks = getattr(self, role).ranks
        if not ranks and role == "ref":
            return self.ranks_of("actor", world)
        return list(ranks) if ranks else list(range(world))
