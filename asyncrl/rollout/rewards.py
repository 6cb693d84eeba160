"""Old path of :mod:`asyncrl.rewards` (issue #47): fails with one line naming it."""

raise ImportError(
    "asyncrl.rollout.rewards moved to asyncrl.rewards: import asyncrl.rewards instead",
    name=__name__,
)
