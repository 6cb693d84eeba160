"""On-policy distillation's advantage (``algorithm.advantage: distill``; docs/distill.md,
docs/off-policy.md): per token, with no critic, from the teacher's logprobs that arrive with each
sample (``rollout.teacher``) and the sampler's own. Pure logic: tensors and arrays in and out.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from asyncrl import metric_names as names
from asyncrl.learner.advantages import masked_rows
from asyncrl.learner.packing import Sequence
from asyncrl.recipe import AlgorithmConfig


def distill(
    log_mu: Tensor,
    log_teacher: Tensor,
    mask: Tensor,
    *,
    outcome: Tensor | float = 0.0,
    coef: float = 0.0,
) -> Tensor:
    """On-policy distillation (Agarwal et al. 2024; Thinking Machines' "On-Policy Distillation"):
    per token A_t = −(log μ_t − log π_teacher,t) + coef·outcome, 0 where the mask is 0.

    log μ_t − log π_teacher,t is the one-sample estimate of the reverse KL(μ ‖ π_teacher) at
    token t (its expectation under μ, which sampled it), so a policy gradient with A_t lowers the
    reverse KL, per token and with no discount: the tinker-cookbook's on-policy distillation
    (``kl_penalty_coef`` 1, ``kl_discount_factor`` 0). μ, not the learner's π_prox: it is the
    policy that sampled the tokens, the one whose KL the estimate is unbiased for; the loss's
    importance weight π_θ/μ then corrects for μ's staleness as it does for any advantage
    (docs/off-policy.md). ``outcome`` is the sample's outcome advantage (a GRPO advantage:
    broadcastable to ``mask``, e.g. ``[B, 1]``), weighted by ``coef`` (``algorithm.distill_coef``;
    0: the teacher alone). No whitening: the KL's scale is the signal. ``[B, T]`` tensors as
    :func:`~asyncrl.learner.advantages.gae`'s (mask-0 inputs may be NaN); float64 inside, returned
    in ``log_mu``'s dtype."""
    m, x = masked_rows(mask, log_mu=log_mu, log_teacher=log_teacher)
    out = torch.as_tensor(outcome, dtype=torch.float64)
    a = x["log_teacher"] - x["log_mu"] + coef * out
    return torch.where(m, a, 0.0).to(log_mu.dtype)


def assign_targets(seqs: list[Sequence], alg: AlgorithmConfig) -> dict[str, float]:
    """Each sequence's ``token_advantages`` from its teacher and behaviour logprobs by
    :func:`distill`, plus ``distill_coef`` times its (already set) per-sample ``advantage``, 0 off
    its trained tokens; returns the batch's reverse KL: the mean of log μ − log π_teacher over its
    trained tokens."""
    kl_sum, tokens = 0.0, 0
    for s in seqs:
        m = s.mask > 0
        if s.teacher_logp is None:
            if m.any():  # learner/step.py refuses such a sample before: a bug if it comes here
                raise ValueError(f"sequence {s.index} has trained tokens and no teacher logprobs")
            s.token_advantages = np.zeros(len(s), np.float32)
            continue
        a = distill(
            torch.from_numpy(s.behavior_logp)[None],
            torch.from_numpy(s.teacher_logp)[None],
            torch.from_numpy(m)[None],
            outcome=s.advantage,
            coef=alg.distill_coef,
        )
        s.token_advantages = a[0].numpy().astype(np.float32)
        kl_sum += float((s.behavior_logp[m].astype(np.float64) - s.teacher_logp[m]).sum())
        tokens += int(m.sum())
    return {names.DISTILL_REVERSE_KL: kl_sum / tokens} if tokens else {}
