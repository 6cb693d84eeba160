"""Old path of :mod:`asyncrl.agents.tool_envs` (issue #47): fails with one line naming it."""

raise ImportError(
    "asyncrl.rollout.tool_envs moved to asyncrl.agents.tool_envs: import asyncrl.agents.tool_envs instead",
    name=__name__,
)
