"""The staleness view: what a step trained at each staleness k = 0…η, so that a user sees whether
old samples still teach (README, "Are old samples teaching?"; ``plots/by_staleness.png``).

A token's staleness k is (version being trained) − (version that sampled it). Per k:

- the tokens trained (mask 1; summed over the step's updates, as ``loss/tokens``);
- the ESS of their importance weights ρ = π_prox/μ (π/μ without π_prox), as ``loss/ess``;
- the fraction a mask dropped (IcePop's band, the sequence mask, any other) and the fraction
  kept whose gradient a clip or the IS cap cut;
- the mean |A|;
- the batch reward: the mean reward of the samples of groups that staleness
  (:func:`reward_by_staleness`, on the host from the batch);
- the KL to the learner is the drift's (:mod:`asyncrl.learner.drift`: ``drift/staleness_kl/k``,
  ``drift/mismatch_kl`` at k = 0), not computed again here.

Like the loss stats, the token quantities come as additive sums: :func:`staleness_sums` is one
float64 ``[η+1, len(COLUMNS)]`` tensor per micro-batch, on the tokens' device, built with one
``index_add_`` and no host read; the step adds them up over micro-batches and ranks and reads the
total once (:func:`finalize_staleness`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from asyncrl import metric_names as names

BY_STALENESS = "by_staleness"
"""The key under which :func:`~asyncrl.learner.losses.policy.policy_loss` returns the micro-batch's
:func:`staleness_sums` when given the tokens' staleness (not one of the scalar ``STAT_KEYS``)."""

COLUMNS = ("tokens", "masked", "clipped", "is_weight", "is_weight_sq", "adv_abs")
"""The columns of :func:`staleness_sums`, each a sum over the trained tokens of one staleness."""


def staleness_sums(
    token_staleness: Tensor,
    valid: Tensor,
    *,
    masked: Tensor,
    clipped: Tensor,
    rho: Tensor,
    advantages: Tensor,
    max_staleness: int,
) -> Tensor:
    """float64 ``[η+1, len(COLUMNS)]``: row k sums over the ``valid`` tokens of staleness k their
    count, those ``masked`` (dropped from the loss), those ``clipped`` (kept, gradient cut), ρ, ρ²
    and |A|. Every argument is flat over one micro-batch's tokens.

    No host read: the staleness bound was checked on the host before (learner/step.py refuses a
    batch that breaks it), so out-of-range values, possible only on tokens that are not
    ``valid`` (tool output), are clamped to a row they add nothing to."""
    v = valid.bool()
    f64 = torch.float64
    zero = torch.zeros((), dtype=f64, device=rho.device)
    w = torch.where(v, rho.detach().to(f64), zero)
    cols = torch.stack(
        [
            v.to(f64),
            (v & masked.bool()).to(f64),
            (v & clipped.bool()).to(f64),
            w,
            w * w,
            torch.where(v, advantages.detach().to(f64).abs(), zero),
        ],
        dim=1,
    )
    k = token_staleness.long().clamp(0, max_staleness).to(cols.device)
    out = torch.zeros(max_staleness + 1, len(COLUMNS), dtype=f64, device=cols.device)
    return out.index_add_(0, k, cols)


def finalize_staleness(sums: Tensor) -> dict[str, float]:
    """Summed ``[η+1, len(COLUMNS)]`` sums → metrics, per staleness k = 0…η:
    ``staleness/tokens/k`` (every k, zeros too), and where k has tokens ``staleness/ess/k``
    ((Σρ)² / (N·Σρ²)), ``staleness/masked_frac/k``, ``staleness/clipped_frac/k`` and
    ``staleness/adv_abs_mean/k``."""
    s = sums.detach().to(torch.float64).cpu().tolist()
    out: dict[str, float] = {}
    for k, row in enumerate(s):
        n, masked, clipped, w, w2, adv = row
        out[f"{names.STALENESS_TOKENS}{k}"] = n
        if n <= 0:
            continue
        out[f"{names.STALENESS_ESS}{k}"] = w * w / (n * w2) if w2 > 0 else 0.0
        out[f"{names.STALENESS_MASKED}{k}"] = masked / n
        out[f"{names.STALENESS_CLIPPED}{k}"] = clipped / n
        out[f"{names.STALENESS_ADV_ABS}{k}"] = adv / n
    return out


def reward_by_staleness(
    staleness: Sequence[int], rewards: Sequence[Sequence[float]], *, max_staleness: int
) -> dict[str, float]:
    """``staleness/reward_mean/k``: the mean reward of the samples of the batch's groups of
    staleness k (a group's staleness is its oldest trained token's, as the buffer counts it in
    ``staleness_hist/k``), for each k that has a group. ``staleness[i]`` and ``rewards[i]`` are
    group i's; a staleness outside 0…η (a group with no trained token) counts at the nearer end.

    Set against the step's on-policy reward, this separates the data effect (stale policies sample
    fewer successes: nothing to learn from) from what the loss does with the samples."""
    total = np.zeros(max_staleness + 1)
    count = np.zeros(max_staleness + 1)
    for k, r in zip(staleness, rewards, strict=True):
        k = min(max(int(k), 0), max_staleness)
        total[k] += float(np.sum(r))
        count[k] += len(r)
    return {
        f"{names.STALENESS_REWARD}{k}": float(total[k] / count[k])
        for k in range(max_staleness + 1)
        if count[k] > 0
    }
