"""An old import path: the agents' machinery (tools, MCP, the recording client, the proxy) moved
to a room of its own, :mod:`asyncrl.agents` (issue #47). Code written against this path fails
here with one line naming the new one."""

raise ImportError(
    "asyncrl.rollout.recording moved to asyncrl.agents.recording: import asyncrl.agents.recording instead",
    name=__name__,
)
