"""Per-turn samples of a multi-turn trajectory (asyncrl/rollout/turns.py, pure)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from asyncrl import wire
from asyncrl.rollout.turns import split_turns, turn_of, turn_spans


def sample(mask: list[int], reward: float = 2.0) -> wire.Sample:
    n = len(mask)
    return wire.Sample(
        id="g/0",
        group_id="g",
        prompt_ids=np.array([7, 8], np.int32),
        completion_ids=np.arange(100, 100 + n, dtype=np.int32),
        behavior_logprobs=-np.arange(1, n + 1, dtype=np.float32) / 10,
        versions=np.array([3] * (n - 2) + [4, 4], np.int32),
        loss_mask=np.array(mask, np.float32),
        reward=reward,
        finish_reason="length",
        metadata={"turns": 3},
    )


def test_turns_are_the_runs_of_trained_tokens():
    assert turn_spans(np.array([1, 1, 0, 0, 1, 0, 1, 1])) == [(0, 2), (4, 5), (6, 8)]
    assert turn_spans(np.array([0, 1])) == [(1, 2)]
    assert turn_spans(np.array([0, 0])) == [] and turn_spans(np.array([])) == []


def test_each_turn_sees_the_conversation_before_it_and_a_discounted_reward():
    s = sample([1, 1, 0, 0, 1, 0, 1, 1])
    a, b, c = split_turns(s, discount=0.5)
    assert [t.id for t in (a, b, c)] == ["g/0.0", "g/0.1", "g/0.2"]
    assert [t.reward for t in (a, b, c)] == [0.5, 1.0, 2.0]
    assert a.prompt_ids.tolist() == [7, 8] and a.completion_ids.tolist() == [100, 101]
    assert b.prompt_ids.tolist() == [7, 8, 100, 101, 102, 103] and b.completion_ids.tolist() == [
        104
    ]
    assert c.prompt_ids.tolist() == [7, 8, *range(100, 106)]
    assert c.completion_ids.tolist() == [106, 107] and c.versions.tolist() == [4, 4]
    assert c.behavior_logprobs.tolist() == pytest.approx([-0.7, -0.8])
    for t in (a, b, c):  # every token of a turn is the model's; per-token arrays agree
        assert t.loss_mask.all() and t.prompt_ids.dtype == np.int32
        assert len({len(t.completion_ids), len(t.behavior_logprobs), len(t.versions)}) == 1
    assert [t.metadata["turn"] for t in (a, b, c)] == [0, 1, 2]
    assert [turn_of(t) for t in (a, b, c)] == [("g/0", k, 3) for k in range(3)]
    assert c.metadata["turns"] == 3 and c.metadata["turns_trained"] == 3
    # the trajectory's sample is unchanged
    assert s.id == "g/0" and len(s.completion_ids) == 8


def test_no_discount_gives_every_turn_the_reward_and_no_turn_leaves_the_sample_whole():
    assert [t.reward for t in split_turns(sample([1, 0, 1]))] == [2.0, 2.0]
    whole = sample([0, 0, 0])
    assert split_turns(whole, 0.5) == [whole]
    assert turn_of(whole) is None and turn_of(sample([1, 0, 1])) is None  # not split


@pytest.mark.parametrize("finish", ["length", "stop", "abort"])
def test_every_turn_carries_the_trajectorys_finish_reason(finish):
    """A trajectory cut at max_new_tokens is cut for all its turns: each earlier turn trains on the
    truncated trajectory's reward, so the overlong filter (``finish_reason == "length"``, in the
    buffer and the learner) must mask every one of them, not the last alone."""
    s = dataclasses.replace(sample([1, 1, 0, 0, 1, 0, 1, 1]), finish_reason=finish)
    assert [t.finish_reason for t in split_turns(s, discount=0.5)] == [finish] * 3
