"""Advantage estimators: hand-computed values, identities, and edge cases (ragged, single, equal)."""

from __future__ import annotations

import math
import typing

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.learner.advantages import (
    ESTIMATORS,
    compute_advantages,
    gae,
    kl_shaped_rewards,
    last_token_rewards,
    remax,
    vtrace,
)
from asyncrl.learner.distill import distill
from asyncrl.recipe import TOKEN_ADVANTAGES, Advantage

KINDS = ["grpo", "dr_grpo", "rloo", "reinforce_pp"]
EPS = 1e-9


def adv(rewards, kind, eps=EPS):
    return compute_advantages(rewards, kind=kind, eps=eps)


def test_grpo_golden():
    # [1,0,0,0]: mean 1/4, unbiased var (9/16 + 3/16)/3 = 1/4, std 1/2.
    # [1,1,0,0]: mean 1/2, unbiased var 1/3.
    out = adv(torch.tensor([[1.0, 0, 0, 0], [1.0, 1, 0, 0]], dtype=torch.float64), "grpo")
    s = 0.5 / math.sqrt(1 / 3)
    expected = torch.tensor([[1.5, -0.5, -0.5, -0.5], [s, s, -s, -s]], dtype=torch.float64)
    torch.testing.assert_close(out, expected)


def test_dr_grpo_golden():
    out = adv(torch.tensor([[1.0, 0, 0, 0], [3.0, 1, 2, 2]]), "dr_grpo")
    torch.testing.assert_close(out, torch.tensor([[0.75, -0.25, -0.25, -0.25], [1.0, -1, 0, 0]]))


def test_rloo_golden():
    # A_i = r_i − mean of the others: [1,0,0,0] → 1 − 0, 0 − 1/3.
    out = adv(torch.tensor([[1.0, 0, 0, 0], [3.0, 1, 2, 2]], dtype=torch.float64), "rloo")
    expected = torch.tensor(
        [[1, -1 / 3, -1 / 3, -1 / 3], [3 - 5 / 3, 1 - 7 / 3, 2 - 2, 2 - 2]], dtype=torch.float64
    )
    torch.testing.assert_close(out, expected)


def test_reinforce_pp_golden():
    # Group-centred: [.75,-.25,-.25,-.25, .5,.5,-.5,-.5]; batch mean 0; population var 1.75/8.
    out = adv(torch.tensor([[1.0, 0, 0, 0], [1.0, 1, 0, 0]], dtype=torch.float64), "reinforce_pp")
    centred = torch.tensor(
        [[0.75, -0.25, -0.25, -0.25], [0.5, 0.5, -0.5, -0.5]], dtype=torch.float64
    )
    torch.testing.assert_close(out, centred / math.sqrt(1.75 / 8))


@pytest.mark.parametrize("kind", KINDS)
def test_equal_rewards_and_singletons_give_exact_zero(kind):
    out = adv([[0.1, 0.1, 0.1], [0.7], [0.3, 0.3]], kind, eps=1e-6)
    for a in out:
        assert torch.equal(a, torch.zeros_like(a)), (kind, out)
    # In float64, mean([0.1]*3) != 0.1 (by 1.4e-17); a tiny residual must not survive as signal.
    t = adv(torch.full((2, 3), 0.1, dtype=torch.float64), kind, eps=1e-6)
    assert torch.equal(t, torch.zeros_like(t)), (kind, t)


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo"])
def test_ragged_groups_match_groupwise(kind):
    groups = [[1.0, 0.0, 0.5], [2.0, -1.0], [0.0, 1.0, 1.0, 0.0, 3.0]]
    together = adv(groups, kind)
    for g, a in zip(groups, together, strict=True):
        torch.testing.assert_close(a, adv(torch.tensor([g]), kind)[0])


def test_shape_and_dtype_follow_input():
    t = adv(torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64), "grpo")
    assert t.shape == (2, 2) and t.dtype == torch.float64
    lst = adv([[1, 0, 1], [2, 3]], "grpo")
    assert [a.shape[0] for a in lst] == [3, 2] and lst[0].dtype == torch.float32


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="algorithm.advantage"):
        adv([[1.0, 0.0]], "ppo")
    with pytest.raises(ValueError, match="non-finite"):
        adv([[1.0, float("nan")]], "grpo")
    with pytest.raises(ValueError, match="at least one sample"):
        adv([[1.0], []], "grpo")


groups_st = st.lists(
    st.lists(st.integers(-40, 40).map(lambda x: x / 4), min_size=1, max_size=6),
    min_size=1,
    max_size=5,
)


@settings(max_examples=60, deadline=None)
@given(groups_st)
def test_rloo_is_leave_one_out(groups):
    out = adv([[float(x) for x in g] for g in groups], "rloo")
    for g, a in zip(groups, out, strict=True):
        for i, r in enumerate(g):
            others = g[:i] + g[i + 1 :]
            want = r - sum(others) / len(others) if others else 0.0
            assert abs(float(a[i]) - want) < 1e-4 * (1 + abs(want))


@settings(max_examples=60, deadline=None)
@given(groups_st, st.floats(-5, 5), st.floats(0.1, 10))
def test_grpo_affine_invariance_and_zero_group_sums(groups, shift, scale):
    base = adv([list(map(float, g)) for g in groups], "grpo")
    moved = adv([[x * scale + shift for x in g] for g in groups], "grpo")
    for a, b in zip(base, moved, strict=True):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    for kind in ("dr_grpo", "rloo", "grpo"):
        for a in adv([list(map(float, g)) for g in groups], kind):
            assert abs(float(a.sum())) < 1e-3 * (1 + float(a.abs().sum()))


@settings(max_examples=60, deadline=None)
@given(groups_st)
def test_reinforce_pp_is_batch_whitened(groups):
    a = torch.cat(adv([list(map(float, g)) for g in groups], "reinforce_pp", eps=1e-12)).double()
    assert abs(float(a.mean())) < 1e-4
    std = float(a.pow(2).mean().sqrt())
    assert std == pytest.approx(1.0, abs=1e-3) or std == 0.0


def test_every_recipe_advantage_is_a_group_estimator_or_a_token_level_one():
    # distill is per token with no critic: the teacher's logprobs (test_distill_* below)
    assert set(ESTIMATORS) | set(TOKEN_ADVANTAGES) | {"distill"} == set(typing.get_args(Advantage))
    assert not set(ESTIMATORS) & (set(TOKEN_ADVANTAGES) | {"distill"})
    for kind in TOKEN_ADVANTAGES:  # per token, from a critic: not from rewards alone
        with pytest.raises(ValueError, match=f"{kind!r} is not a per-sample estimator"):
            adv([[1.0, 0.0]], kind)


# --------------------------------------------------------------------------------------------------
# Token-level estimators
# --------------------------------------------------------------------------------------------------

F64 = torch.float64
NAN = float("nan")


def rows(*xs):
    return torch.tensor(xs, dtype=F64)


def test_gae_golden_with_uneven_rows():
    # γ = 0.9, λ = 0.5, γλ = 0.45. Row 0, backwards from the last token (V after it is 0):
    #   t=2: δ = 1 − 0.8 = 0.2;              A = 0.2;                     R = 1.0
    #   t=1: δ = 0.9·0.8 − 0.6 = 0.12;       A = 0.12 + 0.45·0.2 = 0.21;   R = 0.81
    #   t=0: δ = 0.9·0.6 − 0.5 = 0.04;       A = 0.04 + 0.45·0.21 = 0.1345; R = 0.6345
    # Row 1 ends at t=1 (padding holds NaN): t=1: δ = 2 − 1 = 1, R = 2;
    #   t=0: δ = 0.9·1 − 1 = −0.1, A = −0.1 + 0.45·1 = 0.35, R = 1.35.
    r = rows([0, 0, 1], [0, 2, NAN])
    v = rows([0.5, 0.6, 0.8], [1, 1, NAN])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    a, ret = gae(r, v, mask, gamma=0.9, lam=0.5)
    torch.testing.assert_close(a, rows([0.1345, 0.21, 0.2], [0.35, 1.0, 0]))
    torch.testing.assert_close(ret, rows([0.6345, 0.81, 1.0], [1.35, 2.0, 0]))


def test_gae_skips_mask_zero_tokens_inside_a_row():
    # A tool's output (mask 0) between two trained tokens: its reward 5 and value 99 are not
    # seen; t=0 bootstraps from t=2. t=2: A = 0.2, R = 1; t=0: δ = 0.9·0.8 − 0.5 = 0.22,
    # A = 0.22 + 0.45·0.2 = 0.31, R = 0.81. The same as the row with the hole cut out.
    a, ret = gae(
        rows([0, 5, 1]), rows([0.5, 99, 0.8]), torch.tensor([[1, 0, 1]]), gamma=0.9, lam=0.5
    )
    torch.testing.assert_close(a, rows([0.31, 0, 0.2]))
    torch.testing.assert_close(ret, rows([0.81, 0, 1.0]))
    cut = gae(rows([0, 1]), rows([0.5, 0.8]), torch.ones(1, 2), gamma=0.9, lam=0.5)
    torch.testing.assert_close(cut.advantages, a[:, [0, 2]])


def test_gae_lambda_one_is_monte_carlo_and_zero_is_td():
    r, v, m = rows([0, 0, 1]), rows([0.5, 0.6, 0.8]), torch.ones(1, 3)
    a, ret = gae(r, v, m, gamma=1.0, lam=1.0)  # every token's return is the final reward
    torch.testing.assert_close(ret, rows([1, 1, 1]))
    torch.testing.assert_close(a, rows([0.5, 0.4, 0.2]))
    _, td = gae(r, v, m, gamma=0.5, lam=0.0)  # r_t + γ·V(x_{t+1})
    torch.testing.assert_close(td, rows([0.3, 0.4, 1.0]))


def test_vtrace_golden():
    # γ = 0.9, π/μ = [2, 0.5], ρ̄ = c̄ = 1: ρ = c = [1, 0.5]. Backwards, V after the end = 0:
    #   t=1: v = 0.8 + 0.5·(1 − 0.8) = 0.9;                          A = 1 − 0.8 = 0.2
    #   t=0: v = 0.5 + 1·(0.9·0.8 − 0.5) + 0.9·1·(0.9 − 0.8) = 0.81; A = 0.9·0.9 − 0.5 = 0.31
    # A carries no ρ: the policy loss's own weight is IMPALA's one ρ (docs/off-policy.md).
    # With ρ̄ = 1.5 (c̄ = 1): ρ_0 = 1.5, so v_0 = 0.5 + 1.5·0.22 + 0.09 = 0.92; A unchanged.
    # With π/μ = [0.5, 0.5]: t=0: v = 0.5 + 0.5·0.22 + 0.9·0.5·0.1 = 0.655; A unchanged.
    r, v, m = rows([0, 1]), rows([0.5, 0.8]), torch.ones(1, 2)
    log_mu = rows([-1.0, -1.0])
    log_pi = log_mu + torch.log(rows([2.0, 0.5]))
    a, vs = vtrace(r, v, log_pi, log_mu, m, gamma=0.9, rho_bar=1.0, c_bar=1.0)
    torch.testing.assert_close(vs, rows([0.81, 0.9]))
    torch.testing.assert_close(a, rows([0.31, 0.2]))
    a, vs = vtrace(r, v, log_pi, log_mu, m, gamma=0.9, rho_bar=1.5, c_bar=1.0)
    torch.testing.assert_close(vs, rows([0.92, 0.9]))
    torch.testing.assert_close(a, rows([0.31, 0.2]))
    log_pi = log_mu + math.log(0.5)
    a, vs = vtrace(r, v, log_pi, log_mu, m, gamma=0.9, rho_bar=1.0, c_bar=1.0)
    torch.testing.assert_close(vs, rows([0.655, 0.9]))
    torch.testing.assert_close(a, rows([0.31, 0.2]))


def _random_batch(seed: int, b: int = 4, t: int = 7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    mask[0, 0] = False  # a hole inside a row (e.g. a tool's output)
    mask[0, -1] = True
    r = torch.randn(b, t, generator=g, dtype=F64)
    v = torch.randn(b, t, generator=g, dtype=F64)
    log_mu = -torch.rand(b, t, generator=g, dtype=F64) * 3
    r[~mask], v[~mask], log_mu[~mask] = NAN, NAN, NAN
    return r, v, log_mu, mask


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("lam", [1.0, 0.7])
def test_vtrace_on_policy_is_gae(seed, lam):
    # μ = π with ρ̄ = c̄ = 1: no truncation, v_t = GAE's return with the same λ; at λ = 1 the
    # policy-gradient advantage is GAE's too (ρ(r + γ v_{t+1} − V) = Σ_k γ^k δ_{t+k}).
    r, v, log_mu, mask = _random_batch(seed)
    a, vs = vtrace(r, v, log_mu, log_mu, mask, gamma=0.95, rho_bar=1.0, c_bar=1.0, lam=lam)
    ga, gret = gae(r, v, mask, gamma=0.95, lam=lam)
    torch.testing.assert_close(vs, gret)
    if lam == 1.0:
        torch.testing.assert_close(a, ga)
    assert torch.equal(vs[~mask], torch.zeros_like(vs[~mask]))
    assert torch.isfinite(a).all() and torch.isfinite(vs).all()


@pytest.mark.parametrize("fn", ["gae", "vtrace"])
def test_rows_are_independent_and_padding_does_not_matter(fn):
    r, v, log_mu, mask = _random_batch(3)
    log_pi = torch.where(mask, log_mu + 0.3, NAN)

    def run(r, v, log_pi, log_mu, mask):
        if fn == "gae":
            return gae(r, v, mask, gamma=0.9, lam=0.8)
        return vtrace(r, v, log_pi, log_mu, mask, gamma=0.9, rho_bar=1.0, c_bar=0.9, lam=0.8)

    whole = run(r, v, log_pi, log_mu, mask)
    for i in range(r.shape[0]):
        n = int(mask[i].nonzero().max()) + 1
        one = run(*(x[i : i + 1, :n] for x in (r, v, log_pi, log_mu, mask)))
        for got, want in zip(whole, one, strict=True):
            torch.testing.assert_close(got[i, :n], want[0])
            assert torch.equal(got[i, n:], torch.zeros_like(got[i, n:]))


def test_token_estimators_refuse_bad_shapes_and_nan_at_trained_tokens():
    m = torch.ones(1, 2)
    with pytest.raises(ValueError, match="values: shape"):
        gae(rows([0, 1]), rows([0, 1, 2]), m, gamma=1, lam=1)
    with pytest.raises(ValueError, match="rewards: non-finite"):
        gae(rows([0, NAN]), rows([0, 1]), m, gamma=1, lam=1)
    with pytest.raises(ValueError, match="rho_bar"):
        vtrace(
            rows([0, 1]), rows([0, 1]), rows([0, 0]), rows([0, 0]), m, gamma=1, rho_bar=0, c_bar=1
        )


def test_last_token_rewards():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    out = last_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)
    assert torch.equal(out, torch.tensor([[0, 1.0, 0, 0], [0, 0, 2.0, 0], [0, 0, 0, 0]]))


def test_kl_shaped_rewards_golden():
    # KL_t = log π − log π_ref = [0.5, −1]; r' = r − 0.1·KL = [−0.05, 1.1]; padding gives 0.
    mask = torch.tensor([[1, 1, 0]])
    out = kl_shaped_rewards(
        rows([0, 1, NAN]), rows([-1, -2, NAN]), rows([-1.5, -1, NAN]), mask, beta=0.1
    )
    torch.testing.assert_close(out, rows([-0.05, 1.1, 0]))


def test_remax_subtracts_the_greedy_reward():
    r = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    torch.testing.assert_close(
        remax(r, torch.tensor([0.5, 1.0])), torch.tensor([[0.5, -0.5], [-0.5, -0.5]])
    )
    torch.testing.assert_close(
        remax(r.flatten(), torch.tensor([0.5, 0.5, 1.0, 1.0])),
        torch.tensor([0.5, -0.5, -0.5, -0.5]),
    )
    with pytest.raises(ValueError, match="greedy_rewards"):
        remax(r, torch.tensor([1.0, 2.0, 3.0]))


def test_remax_advantages_are_reward_minus_the_groups_greedy_reward():
    # ragged groups; an all-equal group and a group of one still get r − b (the baseline is outside)
    rewards = [[1.0, 0.0, 1.0], [1.0, 1.0], [0.25]]
    out = compute_advantages(rewards, kind="remax", baselines=[0.5, 0.0, 1.0])
    want = [[0.5, -0.5, 0.5], [1.0, 1.0], [-0.75]]
    for a, w in zip(out, want, strict=True):
        torch.testing.assert_close(a, torch.tensor(w))
    t = compute_advantages(
        torch.tensor([[1.0, 0.0], [2.0, 2.0]], dtype=torch.float64), kind="remax", baselines=[1, 2]
    )
    assert t.dtype == torch.float64
    torch.testing.assert_close(t, torch.tensor([[0.0, -1.0], [0.0, 0.0]], dtype=torch.float64))


def test_remax_group_without_a_baseline_uses_its_mean():
    """A failed greedy episode (baseline None) makes the group's mean its baseline: Dr. GRPO's."""
    out = compute_advantages(
        [[1.0, 0.0, 0.0, 0.0], [1.0, 0.0]], kind="remax", baselines=[None, 0.0]
    )
    torch.testing.assert_close(out[0], adv([[1.0, 0.0, 0.0, 0.0]], "dr_grpo")[0])
    torch.testing.assert_close(out[1], torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="baseline"):
        compute_advantages([[1.0, 0.0]], kind="remax")
    with pytest.raises(ValueError, match="2 for 1 groups"):
        compute_advantages([[1.0, 0.0]], kind="remax", baselines=[0.0, 1.0])
    # the other estimators ignore baselines
    torch.testing.assert_close(
        compute_advantages([[1.0, 0.0]], kind="grpo", baselines=[5.0]), adv([[1.0, 0.0]], "grpo")
    )


# ---- per-turn samples (rollout.turn_samples): the group baseline is over episodes ----------------


def per_turn(groups, gamma):
    """Each group's episodes (R, T) as rollout/turns.py sends them: T samples, turn t with reward
    γ^(T-1-t)·R and its place (episode id, t, T)."""
    rewards = [[gamma ** (T - 1 - t) * R for R, T in g for t in range(T)] for g in groups]
    turns = [
        [(f"{gi}/{e}", t, T) for e, (_, T) in enumerate(g) for t in range(T)]
        for gi, g in enumerate(groups)
    ]
    return rewards, turns


def test_turns_of_one_episode_are_one_member_of_the_group_baseline():
    # Episode A: 3 turns, R = 1; episode B: 1 turn, R = 0. Over episodes RLOO is [1, −1] and GRPO
    # (mean 1/2, std √(1/2)) ±1/√2: every turn of A gets A's value, B's turn B's. Normalised over
    # the 4 samples instead, RLOO gave [1/3, 1/3, 1/3, −1] and GRPO weighed A three times.
    rewards, turns = per_turn([[(1.0, 3), (0.0, 1)]], gamma=1.0)
    rloo = compute_advantages(rewards, kind="rloo", turns=turns)
    torch.testing.assert_close(rloo[0], torch.tensor([1.0, 1.0, 1.0, -1.0]))
    grpo = compute_advantages(rewards, kind="grpo", eps=EPS, turns=turns)
    s = 1 / math.sqrt(2)
    torch.testing.assert_close(grpo[0], torch.tensor([s, s, s, -s]))
    # γ = 1/2: turn t of T gets γ^(T-1-t) × its episode's advantage
    rewards, turns = per_turn([[(1.0, 3), (0.0, 1)]], gamma=0.5)
    rloo = compute_advantages(rewards, kind="rloo", turns=turns, turn_discount=0.5)
    torch.testing.assert_close(rloo[0], torch.tensor([0.25, 0.5, 1.0, -1.0]))


@pytest.mark.parametrize("gamma", [1.0, 0.5, 0.0])
@pytest.mark.parametrize("kind", [*KINDS, "remax"])
def test_group_estimators_over_turns_give_each_turn_its_discounted_episode_advantage(kind, gamma):
    """Every group estimator over per-turn samples equals the estimator over the episodes (one
    reward each, the undiscounted R), turn t of T scaled by γ^(T-1-t); ReMax's greedy baseline
    is undiscounted like R, so it is discounted alike."""
    episodes = [
        [(1.0, 3), (0.0, 1), (0.5, 2)],
        [(2.0, 1), (2.0, 4)],  # all equal: no signal, whatever the turns' discounted rewards
        [(0.0, 2)],  # one episode: no baseline
        [(1.0, 1), (0.0, 2), (0.0, 1), (1.0, 3)],
    ]
    baselines = [0.25, 1.0, None, 1.0]
    by_episode = compute_advantages(
        [[R for R, _ in g] for g in episodes], kind=kind, eps=EPS, baselines=baselines
    )
    rewards, turns = per_turn(episodes, gamma)
    out = compute_advantages(
        rewards, kind=kind, eps=EPS, baselines=baselines, turns=turns, turn_discount=gamma
    )
    for a, e, g in zip(out, by_episode, episodes, strict=True):
        want = [
            gamma ** (T - 1 - t) * x
            for x, (_, T) in zip(e.tolist(), g, strict=True)
            for t in range(T)
        ]
        torch.testing.assert_close(a, torch.tensor(want))
    # whole-episode samples (no place: None) are each their own episode, as without ``turns``
    flat = [[R for R, _ in g] for g in episodes]
    same = compute_advantages(
        flat, kind=kind, eps=EPS, baselines=baselines, turns=[[None] * len(g) for g in flat]
    )
    for a, e in zip(same, by_episode, strict=True):
        torch.testing.assert_close(a, e)


def test_remax_over_turns_discounts_the_greedy_baseline_alike():
    """Every episode and the greedy one succeed: no turn has an advantage. (γ^(T-1-t)·R against
    the undiscounted greedy R gave every earlier turn a negative one.)"""
    rewards, turns = per_turn([[(1.0, 3), (1.0, 2)]], gamma=0.5)
    out = compute_advantages(rewards, kind="remax", baselines=[1.0], turns=turns, turn_discount=0.5)
    torch.testing.assert_close(out[0], torch.zeros(5))
    # the greedy episode failed to score (0): each turn gets γ^(T-1-t)·(R − b)
    out = compute_advantages(rewards, kind="remax", baselines=[0.0], turns=turns, turn_discount=0.5)
    torch.testing.assert_close(out[0], torch.tensor([0.25, 0.5, 1.0, 0.5, 1.0]))


def test_turns_that_do_not_make_whole_episodes_are_refused():
    rewards = [[0.5, 1.0, 0.0]]
    with pytest.raises(ValueError, match="turns: 1 entries for 2 groups"):
        compute_advantages([[1.0], [0.0]], kind="rloo", turns=[[None]])
    with pytest.raises(ValueError, match=r"turns\[0\]: 2 entries for 3 samples"):
        compute_advantages(rewards, kind="rloo", turns=[[("a", 0, 2), ("a", 1, 2)]])
    with pytest.raises(ValueError, match="episode 'a' has no last turn"):
        compute_advantages(rewards, kind="rloo", turns=[[("a", 0, 3), ("a", 1, 3), None]])
    with pytest.raises(ValueError, match="episode 'a': turn 2 of 2"):
        compute_advantages(rewards, kind="rloo", turns=[[("a", 0, 2), ("a", 2, 2), None]])
    with pytest.raises(ValueError, match="episode 'a': turn 1 of 3, an earlier turn said 2"):
        compute_advantages(rewards, kind="rloo", turns=[[("a", 0, 2), ("a", 1, 3), None]])


def test_distill_advantage_is_the_negative_reverse_kl_sample_per_token_by_hand():
    """A_t = log π_teacher,t − log π_t (π: the learner's π_prox): the teacher likes a token more
    than the student does -> positive; mask-0 tokens (padding, a tool's output; may hold NaN)
    get 0."""
    nan = float("nan")
    log_pi = torch.tensor([[-1.0, -2.0, -0.5, nan], [-3.0, -0.1, -0.2, -0.7]], dtype=torch.float64)
    log_t = torch.tensor([[-0.5, -2.5, -0.5, nan], [-1.0, nan, -0.4, -0.7]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]])
    want = torch.tensor([[0.5, -0.5, 0.0, 0.0], [2.0, 0.0, -0.2, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(distill(log_pi, log_t, mask), want)
    # mixed with the outcome: + coef · the sample's (GRPO) advantage, on its trained tokens only
    outcome = torch.tensor([[1.0], [-2.0]], dtype=torch.float64)
    mixed = distill(log_pi, log_t, mask, outcome=outcome, coef=0.5)
    torch.testing.assert_close(mixed, want + torch.where(mask.bool(), 0.5 * outcome, 0.0))
    assert distill(log_pi.float(), log_t.float(), mask).dtype == torch.float32
    with pytest.raises(ValueError, match="log_teacher: non-finite value at a mask-1 token"):
        distill(log_pi, torch.full_like(log_t, nan), mask)


def test_distill_with_the_sampler_in_the_advantage_moves_away_from_the_teacher():
    """Issue #43 item 1's worked example, through the real advantage and loss: a two-token
    vocabulary, teacher [0.5, 0.5], the student π_prox = softmax(z) = [0.5, 0.5] (already the
    teacher), a stale sampler μ = [0.9, 0.1]. The expected update over μ's samples (9 draws of
    token 0, 1 of token 1: μ exactly) with decoupled PPO at one update (weight π/μ):
    - A from log μ (the old code): A = [−0.588, +1.609], expected logit step [−0.549, +0.549],
      away from the optimum (it follows ∇KL(π ‖ μ));
    - A from log π_prox: A = [0, 0], step 0."""
    from asyncrl.learner.losses.aggregation import Normaliser
    from asyncrl.learner.losses.policy import policy_loss
    from asyncrl.recipe import AlgorithmConfig

    log_t = torch.log(torch.tensor([0.5, 0.5], dtype=torch.float64))
    log_mu = torch.log(torch.tensor([0.9, 0.1], dtype=torch.float64))
    tokens = torch.tensor([0] * 9 + [1])
    ones = torch.ones(1, 10)

    def step(log_in_advantage: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = torch.zeros(2, dtype=torch.float64, requires_grad=True)
        logp = torch.log_softmax(z, -1)[tokens]
        a = distill(log_in_advantage[tokens][None], log_t[tokens][None], ones)[0]
        loss, _ = policy_loss(
            cfg=AlgorithmConfig(loss="decoupled_ppo"),
            norm=Normaliser(tokens=10, seqs=10),
            logp=logp,
            mask=ones[0],
            seq_ids=torch.arange(10),
            behavior_logp=log_mu[tokens],
            advantages=a,
            prox_logp=logp.detach(),
        )
        loss.backward()
        return a[[0, 9]], -z.grad

    a, away = step(log_mu)
    torch.testing.assert_close(
        a, torch.tensor([-0.588, 1.609], dtype=torch.float64), atol=1e-3, rtol=0
    )
    torch.testing.assert_close(
        away, torch.tensor([-0.549, 0.549], dtype=torch.float64), atol=1e-3, rtol=0
    )
    a, still = step(torch.log(torch.tensor([0.5, 0.5], dtype=torch.float64)))  # log π_prox
    assert a.abs().max() == 0 and still.abs().max() < 1e-15
