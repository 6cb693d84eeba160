"""Advantage estimators (docs/off-policy.md, docs/design.md §11).

Group estimators give one per-sample advantage from the rewards of a batch of groups. A group is the n samples of one prompt. Every estimator is a function of the flat rewards ``r`` and
each sample's group index ``g``, so groups of different sizes are handled alike. Conventions shared
by all estimators (each is tested):
- a group whose rewards are all equal carries no learning signal: its advantages are exactly 0;
- a group of one sample has no baseline to compare with: its advantage is 0 (never NaN);
- statistics are computed in float64 and the result is returned in the rewards' dtype.

The advantage is per sample; the learner broadcasts it to the sample's completion tokens.
``dr_grpo`` advantages are meant to pair with the ``seq_mean_token_sum_norm`` aggregation in
:mod:`asyncrl.learner.losses.aggregation` (no std and no length normalisation: Dr. GRPO's two bias
fixes).

Token-level estimators (:func:`gae`, :func:`vtrace`) need a critic's per-token values V(x_t). They
take padded ``[B, T]`` tensors, one row per sample's completion, and a ``mask`` of the tokens
trained on: a recursion over time is a loop over columns, the same for every row. The time steps of
a row are its mask-1 tokens only: mask-0 tokens (padding, a tool's output inside a multi-turn
completion) are skipped, as if cut out, so neither their rewards nor their values count, and their
outputs are 0. After a row's last mask-1 token the episode ends and the bootstrapped value is 0,
unless the row is ``truncated`` (cut at ``rollout.max_new_tokens`` or the model's length, no end
token): its episode did not end, and the value after the cut is the row's last value (:func:`gae`).
Inputs at mask-0 positions may hold any value, even NaN. All are computed in float64 without
gradient and returned in the values' dtype.

ReMax (:func:`remax_groups`) is the one group estimator with an outside baseline: each group's
greedy-completion reward, which the rollout worker scores alongside the group
(``wire.Group.baseline_reward``). Its advantages are r_i − b_g, so an all-equal group still has a
signal when the greedy completion scored differently, and a group of one has a baseline.

On-policy distillation's per-token advantage (``algorithm.advantage: distill``) is in
:mod:`asyncrl.learner.distill`.

Per-turn samples (``rollout.turn_samples``, :mod:`asyncrl.rollout.turns`): a group's members are its
episodes, not its samples. :func:`compute_advantages` runs the estimator over one reward per
episode, its undiscounted R (its last turn's reward; the earlier turns' rewards, discounted by the
worker, are not read again), and gives turn t of T γ^(T-1-t) times its episode's advantage
(γ = ``rollout.turn_discount``). Over the samples instead, an episode's own
turns would sit in its baseline (RLOO would no longer leave it out) and a long episode would weigh
more in the mean and std. Discounting the advantage, not the reward before the baseline, is the
discounted return from turn t, γ^(T-1-t)·R, less the baseline discounted alike, γ^(T-1-t)·b: no
turn of an episode that scored its group's baseline has an advantage (an all-equal group gives
exactly 0, and ReMax's greedy R, undiscounted as R is, cancels a successful episode on every turn).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

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


def grpo(r: Tensor, g: Tensor, *, eps: float, baseline: Tensor | None = None) -> Tensor:
    """GRPO: A_i = (r_i − mean_g r) / (std_g r + eps), std with Bessel's correction (TRL, verl)."""
    del baseline
    n, _, c = _group_stats(r, g)
    sq = torch.zeros(int(g.max()) + 1, dtype=r.dtype).index_add_(0, g, c * c)[g]
    std = torch.sqrt(sq / (n - 1).clamp(min=1))
    return c / (std + eps)


def dr_grpo(r: Tensor, g: Tensor, *, eps: float, baseline: Tensor | None = None) -> Tensor:
    """Dr. GRPO: A_i = r_i − mean_g r (no division by the std, which biases towards easy prompts)."""
    del eps, baseline
    return _group_stats(r, g)[2]


def rloo(r: Tensor, g: Tensor, *, eps: float, baseline: Tensor | None = None) -> Tensor:
    """RLOO: A_i = r_i − 1/(n−1) Σ_{j≠i} r_j = n/(n−1) · (r_i − mean_g r); 0 for a group of one."""
    del eps, baseline
    n, _, c = _group_stats(r, g)
    return torch.where(n > 1, n / (n - 1).clamp(min=1) * c, torch.zeros_like(r))


def reinforce_pp(r: Tensor, g: Tensor, *, eps: float, baseline: Tensor | None = None) -> Tensor:
    """REINFORCE++-baseline: a_i = r_i − mean_g r, then A_i = (a_i − mean_B a) / (std_B a + eps).

    mean_B and std_B are over every sample of the batch (population std, as OpenRLHF's whitening;
    OpenRLHF whitens over tokens, we over samples, so long and short answers weigh the same).
    """
    del baseline
    a = _group_stats(r, g)[2]
    centered = a - a.mean()
    return centered / (centered.pow(2).mean().sqrt() + eps)


def remax_groups(r: Tensor, g: Tensor, *, eps: float, baseline: Tensor | None = None) -> Tensor:
    """ReMax over groups: A_i = r_i − b_g with ``baseline`` the per-sample b_g, the group's greedy
    reward; NaN where a group has none (its greedy episode or reward failed, or it was made without
    one), where the group's mean reward stands in, as Dr. GRPO's baseline."""
    del eps
    if baseline is None:
        raise ValueError("remax needs each group's baseline reward (the greedy completion's)")
    _, mean, _ = _group_stats(r, g)
    b = torch.where(torch.isnan(baseline), mean, baseline.to(r.dtype))
    return remax(r, b)


ESTIMATORS: dict[str, Callable[..., Tensor]] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "remax": remax_groups,
}
"""Every group estimator the learner runs: ``fn(r, g, *, eps, baseline)``, ``baseline`` being each
sample's group baseline (only ReMax reads it)."""


TurnPlace = tuple[str, int, int]
"""A per-turn sample's place in its group: (its episode's key, turn t, of T turns)."""


def _episodes(
    r: Tensor, sizes: list[int], turns: Sequence[Sequence[TurnPlace | None]], gamma: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-turn samples as episodes (module docstring): each episode's reward and group index, and
    each sample's episode index and discount γ^(T-1-t). A sample with no place (None) is an episode
    of its own. An episode's reward is its last turn's, the one whose reward is undiscounted."""
    if len(turns) != len(sizes):
        raise ValueError(f"turns: {len(turns)} entries for {len(sizes)} groups")
    rewards = r.tolist()
    ep_reward: list[float | None] = []
    ep_group: list[int] = []
    of: list[int] = []
    discount: list[float] = []
    i = 0
    for gi, (n, places) in enumerate(zip(sizes, turns, strict=True)):
        if len(places) != n:
            raise ValueError(f"turns[{gi}]: {len(places)} entries for {n} samples")
        index: dict[str, tuple[int, int]] = {}  # episode key -> (episode index, T)
        for place in places:
            if place is None:
                e, w = len(ep_reward), 1.0
                ep_reward.append(rewards[i])
                ep_group.append(gi)
            else:
                key, t, T = place
                if not 0 <= t < T:
                    raise ValueError(f"turns[{gi}]: episode {key!r}: turn {t} of {T}")
                e, seen = index.setdefault(key, (len(ep_reward), T))
                if seen != T:
                    raise ValueError(
                        f"turns[{gi}]: episode {key!r}: turn {t} of {T}, an earlier turn said {seen}"
                    )
                if e == len(ep_reward):
                    ep_reward.append(None)
                    ep_group.append(gi)
                if t == T - 1:
                    ep_reward[e] = rewards[i]
                w = gamma ** (T - 1 - t)
            of.append(e)
            discount.append(w)
            i += 1
        for key, (e, _) in index.items():
            if ep_reward[e] is None:
                raise ValueError(f"turns[{gi}]: episode {key!r} has no last turn (its reward)")
    return (
        torch.tensor(ep_reward, dtype=torch.float64),
        torch.tensor(ep_group),
        torch.tensor(of),
        torch.tensor(discount, dtype=torch.float64),
    )


def compute_advantages(
    rewards: Tensor | Sequence[Sequence[float] | Tensor],
    *,
    kind: AdvantageKind,
    eps: float = 1e-6,
    baselines: Sequence[float | None] | None = None,
    turns: Sequence[Sequence[TurnPlace | None]] | None = None,
    turn_discount: float = 1.0,
) -> Tensor | list[Tensor]:
    """Per-sample advantages, shaped like ``rewards``.

    ``rewards`` is either a ``[num_groups, group_size]`` tensor (returns a tensor of that shape) or a
    list of per-group reward lists of any sizes (returns a list of 1-D tensors, one per group).
    ``baselines`` has one entry per group, ``Group.baseline_reward`` (None: the group has none);
    ``remax`` needs it, the other estimators ignore it. ``turns``, shaped like ``rewards``, gives
    each per-turn sample's place in its episode (None: a whole episode), and ``turn_discount`` the
    γ its rewards were discounted with: the estimator then runs over episodes and each turn gets
    its episode's advantage discounted (module docstring).
    """
    if kind not in ESTIMATORS:
        raise ValueError(
            f"algorithm.advantage: {kind!r} is not a per-sample estimator; one of "
            f"{list(ESTIMATORS)} (gae and vtrace are per token, from a critic: learner/critic.py)"
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
            "rewards: non-finite reward (NaN or inf); a rollout worker leaves a failed reward's "
            "sample out of its group, so this one came from elsewhere"
        )
    g = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    if turns is not None:  # the estimator's members are episodes; turns map back to them after
        r, g, of, discount = _episodes(r, sizes, turns, turn_discount)
    b = None
    if baselines is not None:
        if len(baselines) != len(sizes):
            raise ValueError(f"baselines: {len(baselines)} for {len(sizes)} groups")
        b = torch.tensor([math.nan if x is None else x for x in baselines], dtype=torch.float64)
        if torch.isinf(b).any():
            raise ValueError("baselines: infinite baseline reward")
        b = b[g]
    adv = ESTIMATORS[kind](r, g, eps=eps, baseline=b)
    if turns is not None:
        adv = adv[of] * discount
    adv = adv.to(dtype)
    if isinstance(rewards, Tensor):
        return adv.reshape(rewards.shape)
    return list(adv.split(sizes))


# --------------------------------------------------------------------------------------------------
# Token-level estimators: padded [B, T] tensors with a mask
# --------------------------------------------------------------------------------------------------


class TokenAdvantages(NamedTuple):
    """Per-token advantages A_t (for the policy loss) and returns, the value targets R_t (for the
    value loss); both ``[B, T]``, 0 where the mask is 0."""

    advantages: Tensor
    returns: Tensor


def masked_rows(mask: Tensor, **xs: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """The mask as bool and each input as float64 with 0 at mask-0 positions (which may be NaN)."""
    if mask.dim() != 2:
        raise ValueError(f"mask: expected [batch, tokens], got {tuple(mask.shape)}")
    m = mask.bool()
    out = {}
    for name, x in xs.items():
        if x.shape != m.shape:
            raise ValueError(f"{name}: shape {tuple(x.shape)} != mask shape {tuple(m.shape)}")
        x = torch.where(m, x.detach().to(torch.float64), 0.0)
        if not torch.isfinite(x).all():
            raise ValueError(f"{name}: non-finite value at a mask-1 token")
        out[name] = x
    return m, out


def last_token_rewards(scores: Tensor, mask: Tensor) -> Tensor:
    """Token-level rewards from one score per sample: ``scores[b]`` on row b's last mask-1 token,
    0 elsewhere (a row with no mask-1 token gets none). The form :func:`gae` and :func:`vtrace`
    take an outcome reward in."""
    m = mask.bool()
    if m.dim() != 2 or scores.shape != m.shape[:1]:
        raise ValueError(
            f"scores {tuple(scores.shape)} and mask {tuple(m.shape)}: expected [B] and [B, T]"
        )
    pos = torch.arange(m.shape[1], device=m.device).expand_as(m)
    last = torch.where(m, pos, -1).amax(dim=1, keepdim=True)
    r = torch.zeros(m.shape, dtype=scores.dtype, device=scores.device)
    return torch.where((pos == last) & m, scores[:, None].to(r.dtype), r)


def kl_shaped_rewards(
    rewards: Tensor, log_pi: Tensor, log_ref: Tensor, mask: Tensor, *, beta: float
) -> Tensor:
    """Classic RLHF reward shaping: r'_t = r_t − β·KL_t with the k1 estimate KL_t = log π_t − log
    π_ref,t of the sampled token (its expectation under π is KL(π ‖ π_ref)). The penalty then
    reaches the policy through the advantages, per token, instead of through the loss
    (``algorithm.kl_coef``). ``log_pi`` is the policy being trained, π_prox in asyncrl, not the
    sampler μ: the loss's importance weight π/μ already corrects for who sampled, and with log μ
    here r' differs by β·log(π/μ), which adds β·∇KL(π ‖ μ) to every update (docs/off-policy.md,
    "The KL-shaped reward"). 0 where mask is 0."""
    _, x = masked_rows(mask, rewards=rewards, log_pi=log_pi, log_ref=log_ref)
    return (x["rewards"] - beta * (x["log_pi"] - x["log_ref"])).to(rewards.dtype)


def bootstrap_values(values: Tensor, mask: Tensor, truncated: Tensor | None) -> Tensor:
    """``[B]``: the value after each row's last mask-1 token. 0 where the episode ended there; for
    a ``truncated`` row (cut at ``max_new_tokens``, no end token: the episode would have gone on)
    the row's last value V(x_T), the critic's estimate nearest the state after the cut. The state
    after the last token is not an input of the packed row (it predicts no label), so V(x_T)
    stands in for V(x_{T+1}), as AReaL bootstraps a sequence without an end token from its last
    value."""
    m = mask.bool()
    if truncated is None:
        return torch.zeros(m.shape[0], dtype=values.dtype, device=values.device)
    if truncated.shape != m.shape[:1]:
        raise ValueError(f"truncated: shape {tuple(truncated.shape)}, expected ({m.shape[0]},)")
    pos = torch.arange(m.shape[1], device=m.device).expand_as(m)
    last = torch.where(m, pos, -1).amax(dim=1)
    v_last = values.gather(1, last.clamp(min=0)[:, None])[:, 0]
    return torch.where(truncated.bool() & (last >= 0), v_last, 0.0)


def gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    *,
    gamma: float,
    lam: float,
    truncated: Tensor | None = None,
) -> TokenAdvantages:
    """Generalised advantage estimation (Schulman et al. 2016), backwards over each row's mask-1
    tokens t with next(t) the next mask-1 token and V(next) after the last 0, or for a
    ``truncated`` row (``[B]`` bool) its last value (:func:`bootstrap_values`):

        δ_t = r_t + γ·V(x_next(t)) − V(x_t),   A_t = δ_t + γλ·A_next(t),   R_t = A_t + V(x_t)

    λ = 1 makes R_t the discounted return Σ_k γ^k r_{t+k} (unbiased, high variance); λ = 0 the
    one-step TD target r_t + γ·V(x_next(t)). No whitening: a caller wanting whitened advantages
    whitens A after (R stays the value target)."""
    m, x = masked_rows(mask, rewards=rewards, values=values)
    r, v = x["rewards"], x["values"]
    adv = torch.zeros_like(v)
    next_v = bootstrap_values(v, m, truncated)
    next_a = torch.zeros_like(next_v)
    for t in reversed(range(v.shape[1])):
        mt = m[:, t]
        a = r[:, t] + gamma * next_v - v[:, t] + gamma * lam * next_a
        adv[:, t] = torch.where(mt, a, 0.0)
        next_a = torch.where(mt, a, next_a)
        next_v = torch.where(mt, v[:, t], next_v)
    ret = torch.where(m, adv + v, 0.0)
    return TokenAdvantages(adv.to(values.dtype), ret.to(values.dtype))


def vtrace(
    rewards: Tensor,
    values: Tensor,
    log_pi: Tensor,
    log_mu: Tensor,
    mask: Tensor,
    *,
    gamma: float,
    rho_bar: float,
    c_bar: float,
    lam: float = 1.0,
    truncated: Tensor | None = None,
) -> TokenAdvantages:
    """V-trace (IMPALA, Espeholt et al. 2018): value targets for π from tokens sampled by a stale μ.

    With ρ_t = min(ρ̄, π_t/μ_t), c_t = λ·min(c̄, π_t/μ_t) and next(t), V(next) after the last
    token as in :func:`gae` (0, or a ``truncated`` row's last value, which is then also v_next):

        v_t = V(x_t) + ρ_t·(r_t + γ·V(x_next) − V(x_t)) + γ·c_t·(v_next − V(x_next))
        A_t = r_t + γ·v_next − V(x_t)       (the policy-gradient advantage, without ρ_t)

    ``returns`` are the v_t. ρ̄ sets the value function learnt (V^π at ρ̄ = ∞, nearer V^μ below);
    c̄ the variance of the trace. With μ = π and ρ̄, c̄ ≥ 1 both truncations vanish and v_t is
    :func:`gae`'s return with the same λ, so GAE's targets are right only for fresh data and
    V-trace's stay right when the tokens are several versions stale.

    IMPALA's policy gradient is ρ_t·∇log π_t·A_t with ONE importance weight. Every policy loss of
    :mod:`asyncrl.learner.losses.policy` already weights each token by its own π/μ (tis's
    min(π/μ, C), ppo's ratio, ...), so A_t leaves ρ_t out: the loss's weight is the one ρ
    (docs/off-policy.md)."""
    if rho_bar <= 0 or c_bar <= 0:
        raise ValueError(f"rho_bar and c_bar must be > 0, got {rho_bar}, {c_bar}")
    m, x = masked_rows(mask, rewards=rewards, values=values, log_pi=log_pi, log_mu=log_mu)
    r, v = x["rewards"], x["values"]
    log_ratio = x["log_pi"] - x["log_mu"]
    rho = torch.exp(log_ratio.clamp(max=math.log(rho_bar)))
    c = lam * torch.exp(log_ratio.clamp(max=math.log(c_bar)))
    vs = torch.zeros_like(v)
    adv = torch.zeros_like(v)
    next_v = bootstrap_values(v, m, truncated)
    next_vs = next_v.clone()
    for t in reversed(range(v.shape[1])):
        mt = m[:, t]
        vs_t = v[:, t] + rho[:, t] * (r[:, t] + gamma * next_v - v[:, t])
        vs_t = vs_t + gamma * c[:, t] * (next_vs - next_v)
        a = r[:, t] + gamma * next_vs - v[:, t]
        vs[:, t] = torch.where(mt, vs_t, 0.0)
        adv[:, t] = torch.where(mt, a, 0.0)
        next_vs = torch.where(mt, vs_t, next_vs)
        next_v = torch.where(mt, v[:, t], next_v)
    return TokenAdvantages(adv.to(values.dtype), vs.to(values.dtype))


def remax(rewards: Tensor, greedy_rewards: Tensor) -> Tensor:
    """ReMax (Li et al. 2023): A_i = r_i − r_greedy, the baseline being the reward of the same
    prompt's greedy completion (which is scored, not trained on). No critic and no group: one
    extra greedy generation per prompt. ``greedy_rewards`` is shaped like ``rewards`` (one baseline
    per sample) or like ``rewards.shape[:-1]`` (one per prompt, for ``[num_prompts, n]`` rewards)."""
    g = greedy_rewards.to(rewards.dtype)
    if g.shape == rewards.shape[:-1] and rewards.dim() > 0:
        g = g.unsqueeze(-1)
    elif g.shape != rewards.shape:
        raise ValueError(
            f"greedy_rewards {tuple(greedy_rewards.shape)}: expected {tuple(rewards.shape)} or "
            f"{tuple(rewards.shape[:-1])} for rewards {tuple(rewards.shape)}"
        )
    return rewards - g
