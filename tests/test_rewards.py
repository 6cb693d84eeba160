"""Rewards: built-ins, user functions by import path, and failures that never crash the worker."""

from __future__ import annotations

import pytest
import trio

from asyncrl.plugins import PluginError
from asyncrl.rewards import RewardRunner, exact_match, load_reward, math_verify_reward
from tests import rollout_plugins


def _score(runner: RewardRunner, completion: str, row: dict, **extra):
    async def go():
        return await runner.score(
            prompt="1+1=",
            completion=completion,
            prompt_ids=[1, 2, 3, 4],
            completion_ids=list(range(len(completion))),
            row=row,
            extra=extra,
        )

    return trio.run(go)


def test_exact_match_needs_the_policy_to_stop():
    assert exact_match("p", " 42 ", [], [], answer="42") == 1.0
    assert exact_match("p", "42", [], [], answer="42", finish_reason="length") == 0.0
    assert exact_match("p", "41", [], [], answer=42) == 0.0


def test_math_verify_equivalent_answers():
    assert math_verify_reward("p", "so the answer is \\boxed{0.5}", [], [], answer="1/2") == 1.0
    assert math_verify_reward("p", "the answer is 3", [], [], answer="4") == 0.0


def test_answer_key_and_row_fields_reach_the_reward():
    runner = RewardRunner(load_reward("exact_match"), timeout_s=10, answer_key="solution")
    r = _score(runner, "2", {"prompt": "1+1=", "solution": "2"}, finish_reason="stop")
    assert (r.value, r.failure) == (1.0, "")
    runner = RewardRunner(load_reward("tests.rollout_plugins:length_reward"), timeout_s=10)
    assert _score(runner, "abc", {"prompt": "1+1="}).value == 3.0


def test_async_user_reward():
    runner = RewardRunner(load_reward("tests.rollout_plugins:async_reward"), timeout_s=10)
    assert _score(runner, "x", {"answer": "x"}).value == 1.0


def test_raising_reward_is_a_recorded_failure():
    runner = RewardRunner(load_reward("tests.rollout_plugins:raising_reward"), timeout_s=10)
    r = _score(runner, "x", {})
    assert r.value == 0.0
    assert "ValueError" in r.failure and "broken on purpose" in r.failure
    assert runner.stats["failures"] == 1


def test_sleeping_reward_times_out_and_is_recorded():
    rollout_plugins.RELEASE.clear()
    runner = RewardRunner(load_reward("tests.rollout_plugins:sleeping_reward"), timeout_s=0.2)
    try:
        r = _score(runner, "x", {})
    finally:
        rollout_plugins.RELEASE.set()
    assert r.value == 0.0 and "timed out" in r.failure
    assert runner.stats["timeouts"] == 1 and runner.stats["abandoned"] == 1


def test_non_number_reward_is_a_failure():
    runner = RewardRunner(load_reward("tests.rollout_plugins:nan_reward"), timeout_s=10)
    r = _score(runner, "x", {})
    assert r.value == 0.0 and "finite" in r.failure


@pytest.mark.parametrize(
    "spec, match",
    [
        ("no_such_reward", "rollout.reward: 'no_such_reward' is not one of"),
        ("no_such_module_xyz:f", "cannot import module"),
        ("tests.rollout_plugins:missing", "has no 'missing'"),
        ("tests.rollout_plugins:RELEASE", "is not a function"),
    ],
)
def test_bad_reward_names_give_one_line_errors(spec, match):
    with pytest.raises(PluginError, match=match):
        load_reward(spec)
