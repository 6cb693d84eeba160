"""A learner step's staleness view (asyncrl/learner/losses/staleness_stats.py) on a batch of several
staleness, through the real model: every k's tokens, reward and loss numbers, summed over
micro-batches."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl import metric_names as names
from tests.learner.test_model import make_trainer
from tests.learner.test_step import rl_batch

ETA = 4


@pytest.mark.parametrize("micro_batch_tokens", [4096, 24])
def test_a_step_logs_each_stalenesss_tokens_reward_and_loss_numbers(
    tiny_qwen3, tmp_path, micro_batch_tokens
):
    """At version 3 with η = 4: group 0 sampled by version 3 (staleness 0), group 1 by 2 (1), group
    2 by 0 then 1 (its tokens at 3 and 2; the group at 3, its oldest). Nothing at 4."""
    tr = make_trainer(
        tiny_qwen3,
        tmp_path,
        buffer={"max_staleness": ETA},
        learner={"lr": 1e-4, "micro_batch_tokens": micro_batch_tokens},
        algorithm={"loss": "decoupled_ppo", "is_cap": 1.02},
    )
    batch = rl_batch(tr.models.spec.model.vocab_size, groups=3, n=3)
    g0, g1, g2 = batch.groups
    for s in g0.samples:
        s.versions[:] = 3
    for s in g1.samples:
        s.versions[:] = 2
    for s in g2.samples:
        s.versions[:] = 1
        s.versions[: len(s.versions) // 2] = 0
    tr.version = 3
    m = tr.step(batch).metrics
    assert (m["learner/micro_batches"] > 1) == (micro_batch_tokens < 100)

    def tokens(g, v):
        return float(sum(int((s.versions == v).sum()) for s in g.samples))

    expected = [tokens(g0, 3), tokens(g1, 2), tokens(g2, 1), tokens(g2, 0), 0.0]
    assert [m[f"{names.STALENESS_TOKENS}{k}"] for k in range(ETA + 1)] == expected
    assert sum(expected) == m["loss/tokens"]
    # the same buckets as the drift's (k = 0 split there by samples across an update: none here)
    assert [m[f"drift/tokens/{k}"] for k in range(ETA + 1)] == expected

    def reward(g):
        return pytest.approx(float(np.mean(g.rewards)))

    assert m[f"{names.STALENESS_REWARD}0"] == reward(g0)
    assert m[f"{names.STALENESS_REWARD}1"] == reward(g1)
    assert m[f"{names.STALENESS_REWARD}3"] == reward(g2)
    assert {f"{names.STALENESS_REWARD}2", f"{names.STALENESS_REWARD}4"}.isdisjoint(m)
    for k in range(ETA):  # trained buckets: every quantity; the empty one: its count alone
        assert 0 < m[f"{names.STALENESS_ESS}{k}"] <= 1
        assert 0 <= m[f"{names.STALENESS_CLIPPED}{k}"] <= 1
        assert m[f"{names.STALENESS_MASKED}{k}"] == 0.0  # no mask set
        assert m[f"{names.STALENESS_ADV_ABS}{k}"] > 0
    assert not [k for k in m if k.startswith("staleness/") and k.endswith(f"/{ETA}")][1:]
    # the IS cap cut what it cut, wherever the tokens' staleness
    clipped = sum(m[f"{names.STALENESS_CLIPPED}{k}"] * expected[k] for k in range(ETA))
    assert clipped == pytest.approx(m["loss/is_capped_frac"] * m["loss/tokens"]) and clipped > 0
