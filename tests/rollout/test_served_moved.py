"""The old import paths of the rewards (asyncrl.rollout.rewards, now a floor down) and of the
served models' clients (asyncrl.rollout.model_reward, teacher, server_batches, now in a room of
their own) fail with one line naming the new one (issue #47)."""

from __future__ import annotations

import importlib

import pytest

MOVED = {
    "asyncrl.rollout.rewards": "asyncrl.rewards",
    "asyncrl.rollout.model_reward": "asyncrl.served.model_reward",
    "asyncrl.rollout.teacher": "asyncrl.served.teacher",
    "asyncrl.rollout.server_batches": "asyncrl.served.server_batches",
}


@pytest.mark.parametrize(("old", "new"), MOVED.items())
def test_the_old_path_names_the_new_one(old: str, new: str) -> None:
    with pytest.raises(ImportError, match=f"^{old} moved to {new}: import {new} instead$"):
        importlib.import_module(old)
    importlib.import_module(new)


def test_a_recipe_naming_the_old_rewards_path_fails_with_one_line() -> None:
    from asyncrl.plugins import PluginError
    from asyncrl.rewards import load_reward

    with pytest.raises(PluginError) as e:
        load_reward("asyncrl.rollout.rewards:exact_match")
    (line,) = str(e.value).splitlines()
    assert "asyncrl.rollout.rewards moved to asyncrl.rewards" in line
