"""The KL penalty toward the reference policy π_ref (``algorithm.kl_coef``, ``kl_estimator``;
docs/off-policy.md, "The KL penalty").

A regulariser, not a loss: :func:`~asyncrl.learner.losses.policy.policy_loss` adds β·KL_t to
whichever loss the recipe trains, so it stands apart from the losses. Its value and its gradient
are chosen apart (the estimator's value, the reverse KL's gradient; :func:`kl_penalty` says why),
and on tokens a stale sampler μ drew it is importance-weighted (:func:`kl_weight`).
"""

from __future__ import annotations

import torch
from torch import Tensor

KL_CLAMP = 10.0
"""k3 is clamped to [−KL_CLAMP, KL_CLAMP] (its log-ratio to ±20 before the exp), as verl does, so one
token far from π_ref cannot dominate the value. The clamp never touches the gradient."""


def kl_penalty(logp: Tensor, ref_logp: Tensor, *, estimator: str) -> Tensor:
    """Per-token KL(π ‖ π_ref) on tokens sampled from π: the value of Schulman's ``estimator``, with
    the gradient of KL(π ‖ π_ref) (a straight-through carrier, verl's "k1+" / "k3+").

    Values, with δ = log π − log π_ref: k1 = δ; k2 = δ²/2; k3 = e^(−δ) − 1 + δ (unbiased, ≥ 0).
    Gradients through log π (the sampled token is fixed): E_π[∇k1] = E_π[∇log π] = 0, no penalty at
    all; E_π[∇k3] = E_π[(1 − π_ref/π)∇log π] = ∇KL(π_ref ‖ π), the *forward* KL; E_π[∇k2] =
    E_π[δ·∇log π] = ∇KL(π ‖ π_ref). So each estimator goes in as k2 + sg[k − k2]: its value, k2's
    gradient."""
    delta = logp - ref_logp
    k2 = 0.5 * delta * delta
    if estimator == "k1":
        value = delta
    elif estimator == "k2":
        value = k2
    elif estimator == "k3":
        d = delta.clamp(-20.0, 20.0)
        value = (torch.exp(-d) - 1 + d).clamp(-KL_CLAMP, KL_CLAMP)
    else:
        raise ValueError(f"algorithm.kl_estimator: unknown estimator {estimator!r}; k1, k2 or k3")
    return k2 + (value - k2).detach()


def kl_weight(logp: Tensor, behavior_logp: Tensor, *, is_cap: float) -> Tensor:
    """The KL term's importance weight sg[min(π/μ, C)] per token, C = ``algorithm.is_cap``.

    :func:`kl_penalty`'s gradient is KL(π ‖ π_ref)'s only in expectation over tokens from π. The
    batch's tokens come from μ, so unweighted its expected gradient is E_μ[δ·∇log π], the
    gradient of a KL measured where the stale sampler goes, not where π goes. The ratio is the
    current π's (π_θ, not π_prox), also under decoupled PPO: its policy term's weight
    min(π_prox/μ, C)·π_θ/π_prox is ≈ π_θ/μ too, the trust region clipping the second factor; the KL
    term has no trust region, so its full ratio is π_θ/μ (the two agree at the first update, where
    π_θ = π_prox). Capped at C as tis's and decoupled PPO's weights are, per token whatever
    ``is_level``: the KL is a sum of per-token terms, each weighted as the token it was drawn on."""
    return torch.exp(logp.detach() - behavior_logp.detach()).clamp(max=is_cap)
