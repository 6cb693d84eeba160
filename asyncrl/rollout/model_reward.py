"""Old path of :mod:`asyncrl.served.model_reward` (issue #47): fails with one line naming it."""

raise ImportError(
    "asyncrl.rollout.model_reward moved to asyncrl.served.model_reward: import asyncrl.served.model_reward instead",
    name=__name__,
)
