"""On-policy distillation's advantage (``algorithm.advantage: distill``; docs/distill.md,
docs/off-policy.md): per token, with no critic, from the teacher's logprobs that arrive with each
sample (``rollout.teacher``) and the learner's own log π of the update being taken, which exists
only in the learner's forward: the advantage is made there, one micro-batch at a time
(:mod:`asyncrl.learner.passes`).
Pure logic: tensors and arrays in and out.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from asyncrl import metric_names as names
from asyncrl.learner.advantages import masked_rows
from asyncrl.learner.packing import Sequence


def distill(
    log_pi: Tensor,
    log_teacher: Tensor,
    mask: Tensor,
    *,
    outcome: Tensor | float = 0.0,
    coef: float = 0.0,
) -> Tensor:
    """On-policy distillation (Agarwal et al. 2024; Thinking Machines' "On-Policy Distillation"):
    per token A_t = log π_teacher,t − sg[log π_t] + coef·outcome, 0 where the mask is 0, with π the
    policy being trained: the update's own forward, detached. Not π_prox: from a batch's second
    update on (``learner.minibatches`` × ``epochs`` > 1) π has moved from π_prox, and
    log π_T − log π_prox = (log π_T − log π) + log(π/π_prox) adds ∇KL(π ‖ π_prox) to the update.

    The objective is the reverse KL(π ‖ π_T), whose gradient from μ's samples is
    E_μ[(π/μ)·∇log π·(log π_T − log π)]: the loss's importance weight π/μ corrects for sampling
    from μ, and the advantage must be the objective's own −log(π/π_T). With log μ in its place the
    update adds E_π[∇log π·log(π/μ)] = ∇KL(π ‖ μ): it pushes π away from the stale sampler,
    even when π already equals the teacher (docs/off-policy.md, "Which π"). ``outcome`` is the
    sample's outcome advantage (a GRPO advantage, broadcastable to ``mask``), weighted by ``coef``
    (``algorithm.distill_coef``; 0: the teacher alone). No whitening: the KL's scale is the signal.
    ``[B, T]`` tensors as :func:`~asyncrl.learner.advantages.gae`'s (mask-0 inputs may be NaN);
    float64 inside, returned in ``log_pi``'s dtype."""
    m, x = masked_rows(mask, log_pi=log_pi, log_teacher=log_teacher)
    out = torch.as_tensor(outcome, dtype=torch.float64, device=m.device)
    a = x["log_teacher"] - x["log_pi"] + coef * out
    return torch.where(m, a, 0.0).to(log_pi.dtype)


def reverse_kl(seqs: list[Sequence]) -> dict[str, float]:
    """The batch's reverse KL to the teacher as its samplers had it: the mean of
    log μ − log π_teacher over the trained tokens (``distill/reverse_kl``; μ, the policies that
    sampled the batch, for which the one-sample estimate is unbiased). A sequence with trained
    tokens must carry teacher logprobs (learner/step.py refuses such a sample before)."""
    kl_sum, tokens = 0.0, 0
    for s in seqs:
        m = s.mask > 0
        if not m.any():
            continue
        if s.teacher_logp is None:
            raise ValueError(f"sequence {s.index} has trained tokens and no teacher logprobs")
        kl_sum += float((s.behavior_logp[m].astype(np.float64) - s.teacher_logp[m]).sum())
        tokens += int(m.sum())
    return {names.DISTILL_REVERSE_KL: kl_sum / tokens} if tokens else {}
