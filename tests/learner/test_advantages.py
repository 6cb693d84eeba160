"""Advantage estimators: hand-computed values, identities, and edge cases (ragged, single, equal)."""

from __future__ import annotations

import math
import typing

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.learner.advantages import ESTIMATORS, compute_advantages
from asyncrl.recipe import Advantage

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
        adv([[1.0, 0.0]], "gae")
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


def test_every_recipe_advantage_has_an_estimator():
    assert set(ESTIMATORS) == set(typing.get_args(Advantage))
