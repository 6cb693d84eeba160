"""Drift, split in two (DESIGN §4): KL(μ ‖ π_prox) per staleness bucket.

A token's staleness k is (version being trained) − (version of the weights that sampled it). On
k = 0 tokens μ (generator) and π_prox (learner, same weights) differ only by their kernels: that
bucket is the pure engine mismatch. The growth of the KL over buckets 1…η is the drift that
staleness adds on top.

KL(μ ‖ π) is estimated from the sampled tokens (drawn from μ) with Schulman's estimators, ρ = π/μ:
k1 = −log ρ, and k3 = ρ − 1 − log ρ (unbiased, never negative, lower variance; the logged one).

Like the loss stats, the drift comes as additive sums (:func:`drift_sums`, a fixed-shape tensor
that can be summed over micro-batches and all-reduced over ranks) and :func:`finalize_drift`.
"""

from __future__ import annotations

import torch
from torch import Tensor


def drift_sums(
    behavior_logp: Tensor,
    prox_logp: Tensor,
    token_staleness: Tensor,
    mask: Tensor,
    *,
    max_staleness: int,
) -> Tensor:
    """Per staleness bucket k = 0…η, float64 ``[η+1, 3]`` rows of (tokens, Σ k1, Σ k3) over mask-1 tokens.

    A trained token staler than η breaks the hard staleness bound (DESIGN §2): that raises.
    """
    valid = mask.bool()
    k = token_staleness[valid].long()
    if k.numel() and (int(k.min()) < 0 or int(k.max()) > max_staleness):
        raise ValueError(
            f"token staleness in [{int(k.min())}, {int(k.max())}] outside [0, max_staleness="
            f"{max_staleness}]: the staleness bound was broken upstream"
        )
    log_rho = (prox_logp[valid] - behavior_logp[valid]).detach().to(torch.float64)
    k1 = -log_rho
    k3 = torch.exp(log_rho) - 1 - log_rho
    rows = torch.stack([torch.ones_like(k1), k1, k3], dim=1)
    return torch.zeros(max_staleness + 1, 3, dtype=torch.float64, device=rows.device).index_add_(
        0, k, rows
    )


def finalize_drift(sums: Tensor) -> dict[str, float]:
    """Summed ``[η+1, 3]`` drift sums → metrics (k3 estimates; buckets without tokens are left out):

    - ``drift/mismatch_kl``: KL(μ ‖ π_prox) on staleness-0 tokens (engine mismatch only);
    - ``drift/staleness_kl/{k}``: the same on staleness-k tokens, k = 1…η;
    - ``drift/stale_kl``: pooled over every token with staleness ≥ 1;
    - ``drift/kl`` and ``drift/kl_k1``: over all tokens (k3 and k1);
    - ``drift/tokens/{k}``: how many tokens each bucket holds (k = 0…η, zeros included).
    """
    out: dict[str, float] = {}
    n, k1, k3 = (sums[:, i] for i in range(3))
    for k in range(sums.shape[0]):
        out[f"drift/tokens/{k}"] = float(n[k])
        if n[k] > 0:
            out["drift/mismatch_kl" if k == 0 else f"drift/staleness_kl/{k}"] = float(k3[k] / n[k])
    if n[1:].sum() > 0:
        out["drift/stale_kl"] = float(k3[1:].sum() / n[1:].sum())
    if n.sum() > 0:
        out["drift/kl"] = float(k3.sum() / n.sum())
        out["drift/kl_k1"] = float(k1.sum() / n.sum())
    return out


def drift_metrics(
    behavior_logp: Tensor,
    prox_logp: Tensor,
    token_staleness: Tensor,
    mask: Tensor,
    *,
    max_staleness: int,
) -> dict[str, float]:
    """One-shot :func:`finalize_drift` of :func:`drift_sums` (a single micro-batch on one rank)."""
    return finalize_drift(
        drift_sums(behavior_logp, prox_logp, token_staleness, mask, max_staleness=max_staleness)
    )
