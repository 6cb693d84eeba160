"""Broken user code the faults tier names by import path (``fault_plugins:...``), as a recipe would."""

from __future__ import annotations

import threading

from asyncrl.agents.tools import ToolCall
from asyncrl.rollout.workflows import MultiTurn

_NEVER = threading.Event()
HANG_S = 1.5
"""How long a stuck reward takes: past the faults recipe's 1 s timeout, and bounded. A reward that
never returned would hold its thread (and a slot of the runner's limiter of 8) for ever: after four
groups of 2 every later reward would time out waiting for a slot, and the worker stop after
``max_consecutive_failures`` dropped groups."""


def hanging_reward(prompt, completion, prompt_ids, completion_ids, *, hang=False, **row):
    """Stuck past any timeout on rows marked ``hang`` (a slow sandbox, a grader that hangs); 1.0
    otherwise."""
    if hang:
        _NEVER.wait(HANG_S)
    return 1.0


def broken_tool(text: str) -> int:
    """A tool with a bug: it always raises."""
    raise RuntimeError(f"broken tool on {text!r}")


def _always_call(text: str) -> ToolCall | None:
    """Whatever the (random) model wrote becomes a call, so every episode runs the broken tool."""
    return ToolCall(name="broken_tool", arguments={"text": text[:4]})


raising_tool_workflow = MultiTurn(
    tools=[broken_tool], parse_tool_call=_always_call, turn_max_new_tokens=4, max_turns=2
)
