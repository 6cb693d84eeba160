"""Advantage estimators (docs/off-policy.md): one per-sample advantage from the rewards of a batch of groups.

A group is the n samples of one prompt. Every estimator is a function of the flat rewards ``r`` and
each sample's group index ``g``, so groups of different sizes are handled alike. Conventions shared
by all estimators (each is tested):
- a group whose rewards are all equal carries no learning signal: its advantages are exactly 0;
- a group of one sample has no baseline to compare with: its advantage is 0 (never NaN);
- statistics are computed in float64 and the result is returned in the rewards' dtype.

The advantage is per sample; the learner broadcasts it to the sample's completion tokens.
``dr_grpo`` advantages are meant to pair with the ``seq_mean_token_sum_norm`` aggregation in
:mod:`asyncrl.learner.losses` (no std and no length normalisation: Dr. GRPO's two bias fixes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from asyncrl.recipe import Advantage as AdvantageKind


def _group_stats(r: Tensor, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample group size n_g, group mean, and r − mean (exactly 0 in all-equal groups)."""
    num = int(g.max()) + 1
    n = torch.zeros(num, dtype=r.dtype).index_add_(0, g, torch.ones_like(r))
    total = torch.zeros(num, dtype=r.dtype).index_add_(0, g, r)
    lo = torch.full((num,), torch.inf, dtype=r.dtype).scatter_reduce_(0, g, r, "amin")
    hi = torch.full((num,), -torch.inf, dtype=r.dtype).scatter_reduce_(0, g, r, "amax")
    mean = (total / n.clamp(min=1))[g]
    centered = torch.where((lo == hi)[g], torch.zeros_like(r), r - mean)
    return n[g], mean, centered


def grpo(r: Tensor, g: Tensor, *, eps: float) -> Tensor:
    """GRPO: A_i = (r_i − mean_g r) / (std_g r + eps), std with Bessel's correction (TRL, verl)."""
    n, _, c = _group_stats(r, g)
    sq = torch.zeros(int(g.max()) + 1, dtype=r.dtype).index_add_(0, g, c * c)[g]
    std = torch.sqrt(sq / (n - 1).clamp(min=1))
    return c / (std + eps)


def dr_grpo(r: Tensor, g: Tensor, *, eps: float) -> Tensor:
    """Dr. GRPO: A_i = r_i − mean_g r (no division by the std, which biases towards easy prompts)."""
    del eps
    return _group_stats(r, g)[2]


def rloo(r: Tensor, g: Tensor, *, eps: float) -> Tensor:
    """RLOO: A_i = r_i − 1/(n−1) Σ_{j≠i} r_j = n/(n−1) · (r_i − mean_g r); 0 for a group of one."""
    del eps
    n, _, c = _group_stats(r, g)
    return torch.where(n > 1, n / (n - 1).clamp(min=1) * c, torch.zeros_like(r))


def reinforce_pp(r: Tensor, g: Tensor, *, eps: float) -> Tensor:
    """REINFORCE++-baseline: a_i = r_i − mean_g r, then A_i = (a_i − mean_B a) / (std_B a + eps).

    mean_B and std_B are over every sample of the batch (population std, as OpenRLHF's whitening;
    OpenRLHF whitens over tokens, we over samples, so long and short answers weigh the same).
    """
    a = _group_stats(r, g)[2]
    centered = a - a.mean()
    return centered / (centered.pow(2).mean().sqrt() + eps)


ESTIMATORS: dict[str, Callable[..., Tensor]] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
}


def compute_advantages(
    rewards: Tensor | Sequence[Sequence[float] | Tensor], *, kind: AdvantageKind, eps: float = 1e-6
) -> Tensor | list[Tensor]:
    """Per-sample advantages, shaped like ``rewards``.

    ``rewards`` is either a ``[num_groups, group_size]`` tensor (returns a tensor of that shape) or a
    list of per-group reward lists of any sizes (returns a list of 1-D tensors, one per group).
    """
    if kind not in ESTIMATORS:
        raise ValueError(
            f"algorithm.advantage: unknown estimator {kind!r}; one of {list(ESTIMATORS)}"
        )
    if isinstance(rewards, Tensor):
        if rewards.dim() != 2:
            raise ValueError(
                f"rewards: expected [num_groups, group_size], got {tuple(rewards.shape)}"
            )
        groups = list(rewards.unbind(0))
        dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    else:
        groups = [torch.as_tensor(x).reshape(-1) for x in rewards]
        dtype = torch.float32
    sizes = [len(x) for x in groups]
    if not groups or min(sizes) == 0:
        raise ValueError(f"rewards: every group needs at least one sample, got sizes {sizes}")
    r = torch.cat(groups).to(torch.float64)
    if not torch.isfinite(r).all():
        raise ValueError(
            "rewards: non-finite reward (NaN or inf); a failed reward must be a number"
        )
    g = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    adv = ESTIMATORS[kind](r, g, eps=eps).to(dtype)
    if isinstance(rewards, Tensor):
        return adv.reshape(rewards.shape)
    return list(adv.split(sizes))
