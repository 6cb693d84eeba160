"""Old path of :mod:`asyncrl.agents.tools` (issue #47): fails with one line naming it."""

raise ImportError(
    "asyncrl.rollout.tools moved to asyncrl.agents.tools: import asyncrl.agents.tools instead",
    name=__name__,
)
