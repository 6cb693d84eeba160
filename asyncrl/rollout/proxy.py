"""Old path of :mod:`asyncrl.agents.proxy` (issue #47): fails with one line naming it."""

raise ImportError(
    "asyncrl.rollout.proxy moved to asyncrl.agents.proxy: import asyncrl.agents.proxy instead",
    name=__name__,
)
