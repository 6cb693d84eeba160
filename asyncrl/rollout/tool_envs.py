"""An old import path: the agents' machinery (tools, MCP, the recording client, the proxy) moved
to a room of its own, :mod:`asyncrl.agents` (issue #47). Code written against this path fails
here with one line naming the new one."""

raise ImportError(
    "asyncrl.rollout.tool_envs moved to asyncrl.agents.tool_envs: import asyncrl.agents.tool_envs instead",
    name=__name__,
)
