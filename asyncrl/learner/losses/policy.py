"""Policy losses (docs/off-policy.md) on packed, flat token tensors, and :func:`policy_loss`, the
step's policy term: the recipe's loss with its masks and regularisers.

Every tensor is 1-D over the completion tokens of one micro-batch (packed, no padding); ``seq_ids``
says which sequence each token belongs to and ``mask`` which tokens are trained on (the sample's
``loss_mask``; tokens with mask 0 may hold any value, even NaN, and never reach the loss or the
gradient). Notation per token t: π = exp(logp), the current policy (carries the gradient);
μ = exp(behavior_logp), the generator's; π_prox = exp(prox_logp), the learner's weights at the
start of the step; A = advantage; sg[·] = stop-gradient.

Each loss is one function returning the per-token loss ℓ_t and where its clipping was active.
:func:`policy_loss` weights them with the step's global denominators
(:mod:`asyncrl.learner.losses.aggregation`: micro-batch losses add up to the batch's) and returns
its statistics as additive sums (:mod:`asyncrl.learner.losses.stats`). Sequence-level parts
(``gspo``, the sequence mask, sequence-level IS weights) need each sequence whole inside one
micro-batch.
"""

from __future__ import annotations

import math
from typing import get_args

import torch
from torch import Tensor

from asyncrl.learner.losses.aggregation import (
    Normaliser,
    count_tokens_and_seqs,
    seq_sum,
    token_weights,
)
from asyncrl.learner.losses.kl_penalty import kl_penalty, kl_weight
from asyncrl.learner.losses.staleness_stats import BY_STALENESS, staleness_sums
from asyncrl.recipe import AlgorithmConfig, Loss

LOSSES: tuple[str, ...] = tuple(x for x in get_args(Loss) if x != "reward_model")
"""The token losses :func:`policy_loss` computes (reward_model's pairwise loss is
:func:`~asyncrl.learner.losses.scalar.bradley_terry`, on scores, not tokens)."""


def needs_prox(name: str) -> bool:
    """Whether the loss needs π_prox, a forward-only recompute with the step's starting weights."""
    return name in ("decoupled_ppo", "m2po")


def staleness_anchor(logp: Tensor, behavior_logp: Tensor, staleness: Tensor) -> Tensor:
    """A-3PO's proximal anchor (``algorithm.prox_anchor: staleness``), per token:

        log π̂_prox = log μ + (s / (s + 1)) · (sg[log π] − log μ),   s = the token's staleness

    AReaL's ``prox_approx`` interpolates with α = (v_prox − v_behave) / (v_θ − v_behave); the
    update produces v_θ = v_prox + 1 and s = v_prox − v_behave, so α = s / (s + 1) (the issue's
    (k − 1)/k with k = s + 1). A fresh token (s = 0) is anchored at μ, the weights that sampled it
    and that the update starts from; a token s versions old at the point s/(s+1) of the way from μ
    to π, so the clip r = π/π̂_prox = (π/μ)^(1/(s+1)) bounds the drift of one version, which a
    recomputed π_prox cannot do at one update per batch (there π_prox = π and r ≡ 1)."""
    s = staleness.to(logp.dtype).clamp(min=0)
    return behavior_logp + (s / (s + 1)) * (logp.detach() - behavior_logp)


def m2po_threshold(delta_sq: Tensor, tau: float, group: object = None) -> float:
    """M2PO's cut (Zheng et al. 2025, arXiv 2510.01161): the smallest value t such that dropping
    every token with (log π − log μ)² ≥ t leaves a mean second moment ≤ τ over the kept ones;
    ``inf`` when nothing needs dropping. ``delta_sq`` holds this rank's trained tokens' values;
    with a process ``group`` (torch.distributed) the cut is over every rank's tokens of the batch,
    so each rank masks exactly what one rank holding the whole batch would.

    Tokens are dropped largest first: removing a value at least the mean of the rest never raises
    that mean, so ties at t (all dropped) keep the bound."""
    x = delta_sq.detach().to(torch.float64).reshape(-1).cpu()
    if group is not None:
        import torch.distributed as dist

        n = torch.tensor([x.numel()], dtype=torch.int64)
        sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size(group))]
        dist.all_gather(sizes, n, group=group)
        most = int(max(int(z) for z in sizes))
        padded = torch.cat([x, torch.zeros(most - x.numel(), dtype=torch.float64)])
        parts = [torch.zeros(most, dtype=torch.float64) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        x = torch.cat([p[: int(z)] for p, z in zip(parts, sizes, strict=True)])
    n = x.numel()
    if n == 0 or float(x.mean()) <= tau:
        return math.inf
    v = torch.sort(x, descending=True).values
    # mean of the kept after dropping the k largest: (Σ − prefix_k) / (n − k), k = 1..n−1
    rest = v.sum() - torch.cumsum(v, 0)[:-1]
    ok = rest / torch.arange(n - 1, 0, -1, dtype=torch.float64) <= tau
    k = int(torch.nonzero(ok)[0]) + 1 if bool(ok.any()) else n
    return float(v[k - 1])


# --------------------------------------------------------------------------------------------------
# Per-token losses: (ℓ_t, clipping active at t)
# --------------------------------------------------------------------------------------------------


def ppo(
    logp: Tensor,
    behavior_logp: Tensor,
    adv: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    clip_c: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """PPO clip with the generator as π_old: ℓ = −min(r·A, clip(r, 1−ε_low, 1+ε_high)·A), r = π/μ.

    Dual clip (``clip_c`` = c > 1, verl's clip_ratio_c; 0 is off): where A < 0, ℓ = min(ℓ, −c·A).
    With A < 0 the clipped term only bounds r from below, so a token whose ratio to a stale μ has
    grown large would otherwise contribute −r·A without limit. The second value marks where either
    clip took the gradient away."""
    r = torch.exp(logp - behavior_logp)
    unclipped, clipped = r * adv, torch.clamp(r, 1 - clip_low, 1 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    active = clipped < unclipped
    if clip_c > 0:
        bound = -clip_c * adv
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        active = active | dual
    return loss, active


def decoupled_ppo(
    logp: Tensor,
    prox_logp: Tensor,
    behavior_logp: Tensor,
    adv: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    is_cap: float,
    clip_c: float = 0.0,
    seq_ids: Tensor | None = None,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Decoupled PPO (AReaL): ℓ = −w · min(r·A, clip(r, 1−ε_low, 1+ε_high)·A),
    r = π/π_prox, w = sg[min(π_prox/μ, C)]. The trust region is around π_prox, the IS weight
    corrects for sampling from μ; with π_prox = μ (and C ≥ 1) it is exactly :func:`ppo`.
    With ``seq_ids`` the weight is the sequence's, :func:`is_weight`'s min(Π_t π_prox/μ, C).

    π_prox is the policy at the start of the batch's updates. With one update per batch that is the
    policy being trained: r ≡ 1, the clip never acts and the loss equals :func:`tis`. The trust
    region acts from a batch's second update on (``learner.minibatches``, ``learner.epochs``)."""
    w, _ = is_weight(prox_logp - behavior_logp, is_cap=is_cap, seq_ids=seq_ids, mask=mask)
    loss, clip_active = ppo(
        logp, prox_logp, adv, clip_low=clip_low, clip_high=clip_high, clip_c=clip_c
    )
    return w * loss, clip_active


def tis(
    logp: Tensor,
    behavior_logp: Tensor,
    adv: Tensor,
    *,
    is_cap: float,
    seq_ids: Tensor | None = None,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Truncated importance-weighted policy gradient: ℓ = −sg[min(π/μ, C)] · A · log π; with
    ``seq_ids`` the weight is the sequence's, :func:`is_weight`'s min(Π_t π_t/μ_t, C)."""
    w, capped = is_weight(logp - behavior_logp, is_cap=is_cap, seq_ids=seq_ids, mask=mask)
    return -w * adv * logp, capped


def m2po(logp: Tensor, behavior_logp: Tensor, adv: Tensor) -> tuple[Tensor, Tensor]:
    """M2PO (arXiv 2510.01161): ℓ = −sg[π/μ] · A · log π, no clip and no cap; its trust region is
    the second-moment mask :func:`policy_loss` applies (``algorithm.m2po_tau``)."""
    w = torch.exp(logp - behavior_logp).detach()
    return -w * adv * logp, torch.zeros_like(logp, dtype=torch.bool)


def is_weight(
    log_rho: Tensor, *, is_cap: float, seq_ids: Tensor | None = None, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The truncated importance weight of :func:`tis` and :func:`decoupled_ppo`, and where its
    cap C acted. Per token (``algorithm.is_level: token``): w_t = sg[min(ρ_t, C)]. Per sequence
    (``is_level: sequence``, ``seq_ids`` given; verl's sequence-level rollout IS): every token of
    y_i gets w_i = sg[min(Π_{t∈y_i} ρ_t, C)], the product over the sequence's ``mask`` tokens
    (computed as exp(Σ log ρ_t): no overflow, ∞ is capped).

    Π_t ρ_t is the likelihood ratio of the whole completion, the unbiased weight of a
    sequence-level estimator when A is the sequence's; each token's own ρ_t ignores how its
    sequence's earlier tokens moved (low variance, biased). The product's variance grows with the
    length, so C matters more: verl uses 2 to 10."""
    log_rho = log_rho.detach()
    if seq_ids is not None:
        m = torch.ones_like(log_rho, dtype=torch.bool) if mask is None else mask.bool()
        log_rho = seq_sum(torch.where(m, log_rho, 0), seq_ids)
    rho = torch.exp(log_rho)
    return rho.clamp(max=is_cap), rho > is_cap


def cispo(
    logp: Tensor, behavior_logp: Tensor, adv: Tensor, *, clip_low: float | None, clip_high: float
) -> tuple[Tensor, Tensor]:
    """CISPO (MiniMax-M1): ℓ = −sg[min(π/μ, 1+ε_high)] · A · log π. Clipping the weight, not the
    token, keeps every token's gradient. The paper bounds the weight above only (verl's example
    sets its lower ratio to 10, i.e. off): a token whose π/μ fell to 0.3 weighs 0.3. With
    ``clip_low`` (``algorithm.cispo_clip_low``) the weight is also raised to 1−ε_low at least."""
    w = torch.exp(logp - behavior_logp).detach()
    clipped = w.clamp(None if clip_low is None else 1 - clip_low, 1 + clip_high)
    return -clipped * adv * logp, clipped != w


def gspo(
    logp: Tensor,
    behavior_logp: Tensor,
    adv: Tensor,
    *,
    seq_ids: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[Tensor, Tensor]:
    """GSPO-token (Zheng et al. 2025). With s_i = exp(1/|y_i| Σ_{t∈y_i} (log π_t − log μ_t)), the
    geometric mean of the token ratios over the ``mask`` tokens of y_i, each t ∈ y_i has the ratio
    s_i,t = sg[s_i] · π_t/sg[π_t] and ℓ_t = −min(s_i,t·A_t, clip(s_i,t, 1−ε_low, 1+ε_high)·A_t).

    s_i,t has s_i's value, so the clip acts per sequence as GSPO's; its gradient is s_i·∇log π_t,
    on token t alone. With one advantage per sequence (the group estimators) loss and gradient are
    GSPO's: GSPO spreads ∇s_i = s_i/|y_i|·Σ_t ∇log π_t over the tokens and the mean over the
    sequence's tokens gathers it back. With per-token advantages (gae, vtrace, per-turn discounts)
    each token's gradient follows its own A_t, where GSPO's would follow the sequence's mean A.
    ``seq_mean_token_mean`` gives the paper's mean over sequences. GSPO's clip ranges are small
    (paper: 3e-4 / 4e-4); set them in the recipe.
    """
    m, lp = mask.to(logp.dtype), logp.detach()
    log_s = seq_sum((lp - behavior_logp) * m, seq_ids) / seq_sum(m, seq_ids).clamp(min=1)
    s = torch.exp(log_s) * torch.exp(logp - lp)  # s_i,t: s_i's value, gradient s_i·∇log π_t
    unclipped, clipped = s * adv, torch.clamp(s, 1 - clip_low, 1 + clip_high) * adv
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def sft(logp: Tensor) -> tuple[Tensor, Tensor]:
    """Supervised fine-tuning: cross-entropy ℓ = −log π on the target tokens."""
    return -logp, torch.zeros_like(logp, dtype=torch.bool)


# --------------------------------------------------------------------------------------------------
# The step's policy loss
# --------------------------------------------------------------------------------------------------


def policy_loss(
    *,
    cfg: AlgorithmConfig,
    norm: Normaliser,
    logp: Tensor,
    mask: Tensor,
    seq_ids: Tensor,
    behavior_logp: Tensor | None = None,
    advantages: Tensor | None = None,
    prox_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    entropy: Tensor | None = None,
    seq_weights: Tensor | None = None,
    staleness: Tensor | None = None,
    m2po_cut: float = math.inf,
    token_staleness: Tensor | None = None,
    max_staleness: int = 0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's contribution to the step loss, for the loss ``cfg.loss``:

        L = Σ_t c_t · m_t · (ℓ_t + β·KL_t − α·H_t)

    with c_t from ``cfg.aggregation_used`` and ``norm``, ℓ_t the per-token loss, β = ``kl_coef``
    (KL_t from :func:`~asyncrl.learner.losses.kl_penalty.kl_penalty`: the estimator's value,
    KL(π ‖ π_ref)'s gradient, times :func:`~asyncrl.learner.losses.kl_penalty.kl_weight`'s
    sg[min(π/μ, C)] for the RL losses), α = ``entropy_coef``, H_t the caller's per-token entropy (with
    gradient). m_t drops tokens whose
    IS ratio ρ_t = π_prox/μ (π/μ without π_prox) lies outside [ratio_mask_low, ratio_mask_high]
    (IcePop / masked IS), and every token of a sequence whose geometric-mean ratio
    exp(mean_t log ρ_t) lies outside [seq_mask_low, seq_mask_high] (:func:`seq_in_bounds`); a
    bound of 0 is off, and dropped tokens stay in the denominators. ``is_level: sequence`` gives
    tis and decoupled_ppo the sequence's truncated weight (:func:`is_weight`). ``seq_weights``
    (per token) weigh sequences under the sequence-mean aggregations (:func:`token_weights`).
    ``staleness`` (per token; ``algorithm.prox_anchor: staleness``) replaces decoupled_ppo's
    π_prox by :func:`staleness_anchor`. ``m2po`` drops the tokens whose (log π_prox − log μ)² is
    at least ``m2po_cut`` (the batch's :func:`m2po_threshold`), counted in the stats'
    ``m2po_masked``.

    Returns ``(loss, stats)``; ``stats`` are float64 sums (detached) over this micro-batch, always
    keyed by :func:`~asyncrl.learner.losses.stats.stat_keys` of the loss: add them up over micro-batches and
    ranks (start from :func:`~asyncrl.learner.losses.stats.zero_stats`), then call
    :func:`~asyncrl.learner.losses.stats.finalize_stats`. With ``token_staleness`` (per token,
    0…``max_staleness``) and a loss other than sft, ``stats`` also holds
    :data:`~asyncrl.learner.losses.staleness_stats.BY_STALENESS`: the micro-batch's
    :func:`~asyncrl.learner.losses.staleness_stats.staleness_sums` (the masks and clips as applied
    here), a tensor on ``logp``'s device to be summed apart from the scalar stats.
    """
    name = cfg.loss
    if name not in LOSSES:
        raise ValueError(f"algorithm.loss: unknown loss {name!r}; one of {LOSSES}")
    valid = mask.bool()
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)

    def clean(x: Tensor | None, what: str) -> Tensor:
        # Masked positions may hold garbage; zero them so neither loss nor gradient sees NaN/inf.
        if x is None:
            raise ValueError(f"loss {name!r} needs {what}")
        if x.shape != logp.shape:
            raise ValueError(f"{what}: shape {tuple(x.shape)} != logp shape {tuple(logp.shape)}")
        return torch.where(valid, x, zero.to(x.dtype))

    lp = clean(logp, "logp")
    ratio_masked = seq_masked = torch.zeros_like(valid)
    level: dict[str, Tensor] = {}
    if name == "sft":
        log_rho, keep = torch.zeros_like(lp.detach()), valid
        per_token, clip_active = sft(lp)
    else:
        blp = clean(behavior_logp, "behavior_logp").detach()
        adv = clean(advantages, "advantages").detach()
        plp = clean(prox_logp, "prox_logp").detach() if needs_prox(name) else None
        if name == "decoupled_ppo" and cfg.prox_anchor == "staleness":
            k = clean(staleness, "staleness (algorithm.prox_anchor staleness)")
            plp = staleness_anchor(lp, blp, k)
        log_rho = (lp.detach() if plp is None else plp) - blp
        in_band = ratio_in_bounds(torch.exp(log_rho), cfg.ratio_mask_low, cfg.ratio_mask_high)
        ratio_masked = valid & ~in_band
        seq_masked = valid & ~seq_in_bounds(
            log_rho, seq_ids, valid, cfg.seq_mask_low, cfg.seq_mask_high
        )
        keep = valid & ~ratio_masked & ~seq_masked
        if name == "m2po":
            d = plp - blp
            m2po_masked = valid & ((d * d).to(torch.float64) >= m2po_cut)
            keep = keep & ~m2po_masked
        eps = {"clip_low": cfg.clip_low, "clip_high": cfg.clip_high}
        dual = {"clip_c": cfg.clip_c if cfg.dual_clip else 0.0}
        if cfg.is_level == "sequence":
            level = {"seq_ids": seq_ids, "mask": valid}
        if name == "ppo":
            per_token, clip_active = ppo(lp, blp, adv, **eps, **dual)
        elif name == "decoupled_ppo":
            per_token, clip_active = decoupled_ppo(
                lp, plp, blp, adv, **eps, is_cap=cfg.is_cap, **dual, **level
            )
        elif name == "tis":
            per_token, clip_active = tis(lp, blp, adv, is_cap=cfg.is_cap, **level)
        elif name == "m2po":
            per_token, clip_active = m2po(lp, blp, adv)
        elif name == "cispo":
            low = cfg.clip_low if cfg.cispo_clip_low else None
            per_token, clip_active = cispo(lp, blp, adv, clip_low=low, clip_high=cfg.clip_high)
        else:
            per_token, clip_active = gspo(lp, blp, adv, seq_ids=seq_ids, mask=keep, **eps)

    rho = torch.exp(log_rho)
    capped = keep & False
    if name in ("decoupled_ppo", "tis"):
        capped = keep & is_weight(log_rho, is_cap=cfg.is_cap, **level)[1]
    stats = {
        "tokens": valid.sum(),
        "ratio_masked": ratio_masked.sum(),
        "seqs": count_tokens_and_seqs(valid, seq_ids)[1],
        "seq_masked": count_tokens_and_seqs(seq_masked, seq_ids)[1],
        "clipped": (keep & clip_active).sum(),
        "is_capped": capped.sum(),
        "is_weight": torch.where(valid, rho, 0).sum(),
        "is_weight_sq": torch.where(valid, rho * rho, 0).sum(),
        "kl_mu_k1": torch.where(valid, -log_rho, 0).sum(),
        "kl_mu_k3": torch.where(valid, rho - 1 - log_rho, 0).sum(),
        "kl_ref": 0,
        "kl_ref_tokens": 0,
        "entropy": 0,
        "entropy_tokens": 0,
    }
    if name == "m2po":  # a key of its own (stats.stat_keys), so no other loss's metrics change
        stats["m2po_masked"] = m2po_masked.sum()
    if cfg.kl_coef > 0 or ref_logp is not None:
        ref = clean(ref_logp, "ref_logp (algorithm.kl_coef > 0)").detach()
        kl = kl_penalty(lp, ref, estimator=cfg.kl_estimator)
        w = 1.0 if name == "sft" else kl_weight(lp, blp, is_cap=cfg.is_cap)  # μ sampled: π/μ
        per_token = per_token + cfg.kl_coef * w * kl
        stats["kl_ref"] = torch.where(keep, kl.detach(), 0).sum()
        stats["kl_ref_tokens"] = keep.sum()
    if cfg.entropy_coef != 0 or entropy is not None:
        h = clean(entropy, "entropy (algorithm.entropy_coef != 0)")
        per_token = per_token - cfg.entropy_coef * h
        stats["entropy"] = torch.where(keep, h.detach(), 0).sum()
        stats["entropy_tokens"] = keep.sum()
    if token_staleness is not None and name != "sft":
        stats[BY_STALENESS] = staleness_sums(
            token_staleness,
            valid,
            masked=valid & ~keep,
            clipped=keep & (clip_active | capped),
            rho=rho,
            advantages=adv,
            max_staleness=max_staleness,
        )

    # Weights from the trained tokens (ratio-masked tokens stay in every denominator).
    agg = cfg.aggregation_used
    c = token_weights(valid, seq_ids, aggregation=agg, norm=norm, seq_weights=seq_weights)
    c = c.to(per_token.dtype)
    loss = torch.where(keep, per_token * c, 0).sum()
    return loss, {k: torch.as_tensor(v, dtype=torch.float64).detach() for k, v in stats.items()}


def ratio_in_bounds(rho: Tensor, lo: float, hi: float) -> Tensor:
    """IcePop / masked IS: keep tokens with lo ≤ ρ ≤ hi; a bound of 0 is off."""
    keep = torch.ones_like(rho, dtype=torch.bool)
    if lo > 0:
        keep &= rho >= lo
    if hi > 0:
        keep &= rho <= hi
    return keep


def seq_in_bounds(log_rho: Tensor, seq_ids: Tensor, mask: Tensor, lo: float, hi: float) -> Tensor:
    """The sequence mask (``algorithm.seq_mask_low/high``; SkyRL's geometric mask, verl's geometric
    rejection sampling): keep the tokens of each sequence y_i whose geometric-mean ratio
    ρ̄_i = exp(1/|y_i| Σ_{t∈y_i} log ρ_t), over its ``mask`` tokens, lies in [lo, hi]; a bound of 0
    is off. A sequence is judged whole: tokens whose ratios swing both ways but average out keep
    it, as IcePop would not; one whose tokens drift the same way goes, whatever its length (the
    mean, unlike the product, does not grow with it)."""
    if lo <= 0 and hi <= 0:
        return torch.ones_like(mask, dtype=torch.bool)
    m = mask.bool()
    x = torch.where(m, log_rho.detach(), 0)
    mean = seq_sum(x, seq_ids) / seq_sum(m.to(x.dtype), seq_ids).clamp(min=1)
    return ratio_in_bounds(torch.exp(mean), lo, hi)
