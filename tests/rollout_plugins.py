"""User code the rollout tests name by import path (``rollout_plugins:...``), as a recipe would."""

from __future__ import annotations

import threading

RELEASE = threading.Event()
"""Set by a test to let a sleeping reward thread end (so no thread outlives the test for long)."""


def raising_reward(prompt, completion, prompt_ids, completion_ids, **row):
    raise ValueError("this reward is broken on purpose")


def sleeping_reward(prompt, completion, prompt_ids, completion_ids, **row):
    RELEASE.wait(30.0)  # past any timeout a test sets; released at the end of the test
    return 1.0


def length_reward(prompt, completion, prompt_ids, completion_ids, **row):
    """A reward that uses every argument, so a test can check what it was given."""
    assert len(completion) == len(completion_ids) and len(prompt) == len(prompt_ids)
    return float(len(completion_ids))


def nan_reward(prompt, completion, prompt_ids, completion_ids, **row):
    return float("nan")


async def async_reward(prompt, completion, prompt_ids, completion_ids, *, answer=None, **row):
    return 1.0 if completion == answer else 0.5
