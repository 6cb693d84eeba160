"""Old path of :mod:`asyncrl.agents.mcp_server` (issue #47): fails with one line naming it."""

raise ImportError(
    "asyncrl.rollout.mcp_server moved to asyncrl.agents.mcp_server: import asyncrl.agents.mcp_server instead",
    name=__name__,
)
