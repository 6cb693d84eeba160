"""Drift metrics: KL(μ ‖ π_prox) per staleness bucket, its estimators, and summability."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.learner.drift import drift_metrics, drift_sums, finalize_drift

F64 = torch.float64


def k3(rho: float) -> float:
    return rho - 1 - math.log(rho)


def test_buckets_golden():
    # Tokens: staleness 0 with ρ = π_prox/μ = 1, 1.1; staleness 2 with ρ = 2, 0.5; a masked token.
    blp = torch.tensor([-1.0, -1.0, -2.0, -2.0, -3.0], dtype=F64)
    rho = torch.tensor([1.0, 1.1, 2.0, 0.5, 50.0], dtype=F64)
    stale = torch.tensor([0, 0, 2, 2, 1])
    mask = torch.tensor([True, True, True, True, False])
    m = drift_metrics(blp, blp + torch.log(rho), stale, mask, max_staleness=2)
    assert m["drift/mismatch_kl"] == pytest.approx((k3(1.0) + k3(1.1)) / 2)
    assert m["drift/staleness_kl/2"] == pytest.approx((k3(2.0) + k3(0.5)) / 2)
    assert "drift/staleness_kl/1" not in m  # the only staleness-1 token is masked
    assert [m[f"drift/tokens/{k}"] for k in range(3)] == [2.0, 0.0, 2.0]
    assert m["drift/stale_kl"] == pytest.approx(m["drift/staleness_kl/2"])
    assert m["drift/kl"] == pytest.approx(sum(map(k3, [1.0, 1.1, 2.0, 0.5])) / 4)
    assert m["drift/kl_k1"] == pytest.approx(-sum(map(math.log, [1.0, 1.1, 2.0, 0.5])) / 4)


def test_same_weights_give_zero_drift():
    blp = -torch.rand(10, dtype=F64)
    m = drift_metrics(blp, blp.clone(), torch.arange(10) % 3, torch.ones(10), max_staleness=2)
    assert m["drift/kl"] == 0.0 and m["drift/mismatch_kl"] == 0.0


def test_staleness_outside_the_bound_raises():
    blp = torch.zeros(3, dtype=F64)
    with pytest.raises(ValueError, match="max_staleness=1"):
        drift_sums(blp, blp, torch.tensor([0, 1, 2]), torch.ones(3), max_staleness=1)
    with pytest.raises(ValueError, match="staleness"):
        drift_sums(blp, blp, torch.tensor([0, -1, 0]), torch.ones(3), max_staleness=1)
    # A masked token is not trained on, so its staleness does not matter.
    mask = torch.tensor([True, True, False])
    assert drift_sums(blp, blp, torch.tensor([0, 1, 9]), mask, max_staleness=1)[:, 0].sum() == 2


def test_empty_batch():
    m = finalize_drift(torch.zeros(3, 3, dtype=F64))
    assert m == {"drift/tokens/0": 0.0, "drift/tokens/1": 0.0, "drift/tokens/2": 0.0}


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), cut=st.integers(0, 40))
def test_sums_over_micro_batches_equal_one_batch(seed, cut):
    gen = torch.Generator().manual_seed(seed)
    n = 40
    blp = -torch.rand(n, generator=gen, dtype=F64) * 3
    prox = blp + torch.randn(n, generator=gen, dtype=F64) * 0.3
    stale = torch.randint(0, 4, (n,), generator=gen)
    mask = torch.rand(n, generator=gen) > 0.3
    whole = drift_sums(blp, prox, stale, mask, max_staleness=3)
    parts = sum(
        drift_sums(blp[s], prox[s], stale[s], mask[s], max_staleness=3)
        for s in (slice(0, cut), slice(cut, n))
    )
    torch.testing.assert_close(parts, whole)
    m = finalize_drift(whole)
    assert all(v >= 0 for k, v in m.items() if k != "drift/kl_k1")  # k3 is never negative


def test_k3_is_an_unbiased_estimate_of_kl_mu_pi():
    """Tokens sampled from μ: the mean of k3 (and of k1) approaches the exact KL(μ ‖ π)."""
    gen = torch.Generator().manual_seed(0)
    mu = torch.softmax(torch.randn(6, generator=gen, dtype=F64), 0)
    pi = torch.softmax(torch.log(mu) + 0.5 * torch.randn(6, generator=gen, dtype=F64), 0)
    exact = float((mu * (mu.log() - pi.log())).sum())
    tok = torch.multinomial(mu, 200_000, replacement=True, generator=gen)
    blp, plp = mu.log()[tok], pi.log()[tok]
    m = drift_metrics(blp, plp, torch.zeros_like(tok), torch.ones_like(tok), max_staleness=0)
    rho = (plp - blp).exp()
    se = float((rho - 1 - rho.log()).std()) / math.sqrt(len(tok))
    assert abs(m["drift/mismatch_kl"] - exact) < 5 * se, (m, exact, se)
    se1 = float(rho.log().std()) / math.sqrt(len(tok))
    assert abs(m["drift/kl_k1"] - exact) < 5 * se1, (m, exact, se1)
    assert exact > 0.02  # the distributions differ enough for the check to mean something
