"""The staleness view's sums (asyncrl/learner/losses/staleness_stats.py): hand-computed rows, their
metrics, additivity over micro-batches, no host read, and the same masks and clips the loss used."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from asyncrl import metric_names as names
from asyncrl.learner.losses.aggregation import Normaliser
from asyncrl.learner.losses.policy import policy_loss
from asyncrl.learner.losses.staleness_stats import (
    BY_STALENESS,
    COLUMNS,
    finalize_staleness,
    reward_by_staleness,
    staleness_sums,
)
from asyncrl.learner.losses.stats import finalize_stats
from asyncrl.recipe import AlgorithmConfig

F64 = torch.float64

# Six tokens: staleness 0, 0, 1, 2, 2 and one not trained (garbage: NaN ρ, ∞ A, staleness 99)
STALE = torch.tensor([0, 0, 1, 2, 2, 99])
VALID = torch.tensor([True, True, True, True, True, False])
MASKED = torch.tensor([False, True, False, False, False, True])
CLIPPED = torch.tensor([False, False, True, False, True, True])
RHO = torch.tensor([1.0, 2.0, 1.0, 0.5, 1.5, float("nan")], dtype=F64)
ADV = torch.tensor([1.0, -1.0, 2.0, -0.5, 0.5, float("inf")], dtype=F64)


def sums(sl: slice = slice(None)) -> torch.Tensor:
    return staleness_sums(
        STALE[sl],
        VALID[sl],
        masked=MASKED[sl],
        clipped=CLIPPED[sl],
        rho=RHO[sl],
        advantages=ADV[sl],
        max_staleness=3,
    )


def test_rows_golden():
    s = sums()
    assert s.dtype == F64 and s.shape == (4, len(COLUMNS))
    # columns: tokens, masked, clipped, Σρ, Σρ², Σ|A|
    assert s.tolist() == [
        [2.0, 1.0, 0.0, 3.0, 5.0, 2.0],
        [1.0, 0.0, 1.0, 1.0, 1.0, 2.0],
        [2.0, 0.0, 1.0, 2.0, 2.5, 1.0],
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # the untrained token's garbage reaches no row
    ]


def test_metrics_golden():
    m = finalize_staleness(sums())
    assert [m[f"{names.STALENESS_TOKENS}{k}"] for k in range(4)] == [2.0, 1.0, 2.0, 0.0]
    assert m[f"{names.STALENESS_ESS}0"] == pytest.approx(9 / (2 * 5))  # (Σρ)² / (N·Σρ²)
    assert m[f"{names.STALENESS_ESS}1"] == pytest.approx(1.0)
    assert m[f"{names.STALENESS_ESS}2"] == pytest.approx(4 / (2 * 2.5))
    assert m[f"{names.STALENESS_MASKED}0"] == 0.5 and m[f"{names.STALENESS_MASKED}2"] == 0.0
    assert m[f"{names.STALENESS_CLIPPED}1"] == 1.0 and m[f"{names.STALENESS_CLIPPED}2"] == 0.5
    assert m[f"{names.STALENESS_ADV_ABS}0"] == 1.0 and m[f"{names.STALENESS_ADV_ABS}2"] == 0.5
    # a staleness without tokens has its count (0) and nothing else
    assert {k for k in m if k.endswith("/3")} == {f"{names.STALENESS_TOKENS}3"}


def test_micro_batch_sums_add_up_to_the_batchs():
    assert torch.equal(sums(slice(0, 2)) + sums(slice(2, None)), sums())


def test_no_host_read():
    """Built on the meta device, where reading a value to the host raises: the sums of a
    micro-batch never wait on the device."""
    meta = torch.device("meta")
    s = staleness_sums(
        STALE.to(meta),
        VALID.to(meta),
        masked=MASKED.to(meta),
        clipped=CLIPPED.to(meta),
        rho=RHO.to(meta),
        advantages=ADV.to(meta),
        max_staleness=3,
    )
    assert s.device == meta and s.shape == (4, len(COLUMNS))
    with pytest.raises(NotImplementedError):
        s.tolist()


def test_reward_by_staleness_golden():
    got = reward_by_staleness(
        [0, 2, 2, 7, -1], [[1.0, 0.0], [1.0, 1.0], [0.0, 0.0, 0.0], [1.0], [0.5]], max_staleness=3
    )
    assert got == {
        f"{names.STALENESS_REWARD}0": pytest.approx(1.5 / 3),  # groups at 0 and (clamped) −1
        f"{names.STALENESS_REWARD}2": pytest.approx(2.0 / 5),  # 5 samples of 2 groups
        f"{names.STALENESS_REWARD}3": 1.0,  # 7, past the bound, at the bound
    }


def test_policy_loss_sums_the_masks_and_clips_it_applied_by_staleness():
    """tis with the IS cap C = 2 and IcePop's band ρ ≤ 5: tokens with ρ = 1 (kept), 3 (capped)
    and 10 (masked) at staleness 0, 1 and 2, a fourth at staleness 2 kept; per staleness the
    counts add up to the loss's own."""
    blp = torch.full((4,), -2.0, dtype=F64)
    rho = torch.tensor([1.0, 3.0, 10.0, 1.0], dtype=F64)
    cfg = dataclasses.replace(
        AlgorithmConfig(loss="tis"), is_cap=2.0, ratio_mask_high=5.0, aggregation="token_mean"
    )
    loss = functools.partial(
        policy_loss,
        cfg=cfg,
        norm=Normaliser(tokens=4, seqs=1),
        logp=blp + torch.log(rho),
        mask=torch.ones(4, dtype=torch.bool),
        seq_ids=torch.zeros(4, dtype=torch.long),
        behavior_logp=blp,
    )
    _, stats = loss(
        advantages=torch.tensor([1.0, -2.0, 3.0, 0.0], dtype=F64),
        token_staleness=torch.tensor([0, 1, 2, 2]),
        max_staleness=2,
    )
    by_k = stats.pop(BY_STALENESS)
    m = finalize_staleness(by_k)
    assert [m[f"{names.STALENESS_TOKENS}{k}"] for k in range(3)] == [1.0, 1.0, 2.0]
    assert [m[f"{names.STALENESS_MASKED}{k}"] for k in range(3)] == [0.0, 0.0, 0.5]
    assert [m[f"{names.STALENESS_CLIPPED}{k}"] for k in range(3)] == [0.0, 1.0, 0.0]
    assert [m[f"{names.STALENESS_ADV_ABS}{k}"] for k in range(3)] == [1.0, 2.0, 1.5]
    assert m[f"{names.STALENESS_ESS}2"] == pytest.approx(11**2 / (2 * 101))
    whole = finalize_stats(stats)
    assert by_k[:, 0].sum() == whole["loss/tokens"]
    assert by_k[:, 1].sum() / 4 == whole["loss/ratio_masked_frac"]
    assert by_k[:, 2].sum() / 4 == whole["loss/is_capped_frac"]  # tis's clip is its cap
    assert m[f"{names.STALENESS_ESS}0"] == 1.0
    # without the tokens' staleness, the stats are the loss's alone
    _, plain = loss(advantages=torch.zeros(4, dtype=F64))
    assert BY_STALENESS not in plain
