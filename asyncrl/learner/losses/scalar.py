"""The losses of the scalar-head models (:mod:`asyncrl.learner.scalar_model`): a critic's
:func:`value_loss` and a reward model's :func:`bradley_terry`, and :func:`explained_variance`,
which judges a critic's values.

They train a value per token or a score per sequence, not a policy, and only the critic
(:mod:`asyncrl.learner.critic`) and the reward model (:mod:`asyncrl.learner.reward_model`) call
them. They follow the policy loss's rules: global denominators
(:mod:`asyncrl.learner.losses.aggregation`), so micro-batch losses add up to the batch's, and
float64 stats that add up over micro-batches and ranks (:mod:`asyncrl.learner.losses.stats`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from asyncrl.learner.losses.aggregation import Normaliser, token_weights


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    *,
    mask: Tensor,
    seq_ids: Tensor,
    clip: float,
    aggregation: str,
    norm: Normaliser,
) -> tuple[Tensor, dict[str, Tensor]]:
    """A critic's clipped value loss (PPO), this micro-batch's contribution:

        L_V = Σ_t c_t · ½·max((V_t − R_t)², (V_clip,t − R_t)²),  V_clip = V_old + clip(V − V_old, −ε_v, ε_v)

    with V the critic's values (carrying the gradient), V_old the values the returns R were computed
    with (:func:`asyncrl.learner.advantages.gae` or ``vtrace``), ε_v = ``clip`` (``algorithm.
    value_clip``; 0 is off: plain ½(V − R)²), c_t from ``aggregation`` and ``norm`` as the policy
    loss's. The clip keeps one step's value change near V_old, as the ratio clip does for π; taking
    the max makes it pessimistic. Stats are float64 sums: ``value_tokens`` and ``value_clipped``
    (tokens where the clipped term was larger, so the gradient is gone);
    :func:`~asyncrl.learner.losses.stats.finalize_stats` turns them into
    ``loss/value_clip_frac``."""
    valid = mask.bool()
    for name, x in (("old_values", old_values), ("returns", returns)):
        if x.shape != values.shape:
            raise ValueError(
                f"{name}: shape {tuple(x.shape)} != values shape {tuple(values.shape)}"
            )
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(valid, values, zero)
    v_old = torch.where(valid, old_values.detach(), zero)
    ret = torch.where(valid, returns.detach(), zero)
    unclipped = (v - ret) ** 2
    if clip > 0:
        clipped = (v_old + torch.clamp(v - v_old, -clip, clip) - ret) ** 2
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        active = valid & (clipped > unclipped)
    else:
        per_token, active = 0.5 * unclipped, torch.zeros_like(valid)
    c = token_weights(valid, seq_ids, aggregation=aggregation, norm=norm).to(per_token.dtype)
    loss = torch.where(valid, per_token * c, zero).sum()
    stats = {"value_tokens": valid.sum(), "value_clipped": active.sum()}
    return loss, {k: v.to(torch.float64).detach() for k, v in stats.items()}


def bradley_terry(
    chosen: Tensor, rejected: Tensor, *, pairs: float | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """A reward model's pairwise loss (Bradley–Terry; InstructGPT's RM), from the scalar scores
    s_c, s_r of each pair's chosen and rejected completions:

        L = 1/N · Σ_pairs −log σ(s_c − s_r)    (computed as softplus(s_r − s_c): no overflow)

    P(chosen ≻ rejected) = σ(s_c − s_r), so this is the pairs' negative log-likelihood; only score
    differences are learnt. N = ``pairs``, the step's global count (as :class:`Normaliser`'s, so
    micro-batch losses add up to the batch's); default: this micro-batch's pairs. Stats are float64
    sums: ``rm_pairs``, ``rm_correct`` (s_c > s_r strictly: a tie is not a correct ranking) and
    ``rm_margin`` (Σ s_c − s_r); :func:`~asyncrl.learner.losses.stats.finalize_stats` gives
    ``loss/rm_accuracy`` and ``loss/rm_margin``."""
    if chosen.shape != rejected.shape or chosen.dim() != 1:
        raise ValueError(
            f"chosen {tuple(chosen.shape)} and rejected {tuple(rejected.shape)}: expected [pairs]"
        )
    d = chosen - rejected
    n = chosen.shape[0] if pairs is None else pairs
    loss = torch.nn.functional.softplus(-d).sum() / max(n, 1)
    stats = {
        "rm_pairs": torch.tensor(d.shape[0], device=d.device),
        "rm_correct": (d > 0).sum(),
        "rm_margin": d.sum(),
    }
    return loss, {k: v.to(torch.float64).detach() for k, v in stats.items()}


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 − Var[R − V] / Var[R] over the mask-1 tokens: how much of the returns' spread the critic
    predicts. 1 is perfect, 0 no better than the mean, < 0 worse than the mean. Returns without
    variance (or no tokens) give 0: there is nothing to explain. The ratio is the same with or
    without Bessel's correction."""
    return explained_variance_from_sums(variance_sums(values, returns, mask))


def variance_sums(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """``[n, Σ R, Σ R², Σ (R − V), Σ (R − V)²]`` over the mask-1 tokens, float64: sums that add up
    over micro-batches and ranks (all-reduce) before :func:`explained_variance_from_sums`."""
    m = mask.bool()
    r = returns.detach().to(torch.float64)[m]
    d = r - values.detach().to(torch.float64)[m]
    return torch.stack(
        [torch.tensor(float(r.numel()), dtype=torch.float64), r.sum(), r.square().sum()]
        + [d.sum(), d.square().sum()]
    )


def explained_variance_from_sums(sums: Tensor) -> float:
    """:func:`explained_variance` from :func:`variance_sums` (summed over ranks)."""
    n, r, r2, d, d2 = (float(x) for x in sums)
    if n == 0:
        return 0.0
    var_r = r2 / n - (r / n) ** 2
    if var_r <= 1e-12 * max(1.0, r2 / n):  # constant returns (up to the sums' rounding)
        return 0.0
    return 1.0 - (d2 / n - (d / n) ** 2) / var_r
