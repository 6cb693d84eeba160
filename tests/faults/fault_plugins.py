"""Broken user code the faults tier names by import path (``fault_plugins:...``), as a recipe would."""

from __future__ import annotations

import threading

from asyncrl.rollout.tools import ToolCall
from asyncrl.rollout.workflows import MultiTurn

_NEVER = threading.Event()


def hanging_reward(prompt, completion, prompt_ids, completion_ids, *, hang=False, **row):
    """Never returns on rows marked ``hang`` (a stuck sandbox, a dead grader); 1.0 otherwise."""
    if hang:
        _NEVER.wait()
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
