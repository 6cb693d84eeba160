"""The agent demo's tool and reward (recipes/demo_agent.yaml, docs/agents.md).

The task (:func:`asyncrl.tasks.lookup_value`): a prompt names a 3-letter key, ``kqz?``; the answer is
that key's value in a table of random 3-digit values that only the ``lookup`` tool knows. An episode
that solves it calls the tool and answers with its result::

    kqz?<tool>{"name":"lookup","arguments":{"key":"kqz"}}</tool>
    <result>583</result>
    =583

``python -m asyncrl.agents.demo_agent`` serves the tool over MCP's stdio transport (the recipe's
``rollout.tools: ["mcp:stdio:python -m asyncrl.agents.demo_agent"]``; one server per episode, so
it is the standard-library server of :mod:`asyncrl.agents.mcp_server`, which starts fast).
:func:`reward` is the recipe's ``rollout.reward``. The old name, ``asyncrl.demo_agent``, still
works (a recipe written before issue #47 names it).
"""

from __future__ import annotations

import argparse
import string
from typing import Any

from asyncrl import tasks
from asyncrl.agents.mcp_server import ServedTool, StdioServer

KEY_CHARS = set(string.ascii_lowercase)


def lookup(key: str) -> str:
    """Look up a key's value in the table."""
    if not isinstance(key, str) or len(key) != tasks.LOOKUP_KEY_LETTERS or set(key) - KEY_CHARS:
        raise ValueError(f"no key {key!r}: keys are {tasks.LOOKUP_KEY_LETTERS} lowercase letters")
    return tasks.lookup_value(key)


LOOKUP = ServedTool(
    name=tasks.LOOKUP_TOOL,
    description="Look up a key's value in the table.",
    input_schema={
        "type": "object",
        "properties": {"key": {"type": "string", "description": "3 lowercase letters"}},
        "required": ["key"],
    },
    fn=lookup,
)


def reward(
    prompt: str,
    completion: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    *,
    answer: Any = None,
    finish_reason: str = "stop",
    **row: Any,
) -> float:
    """1 if the episode's final answer (the text after the last tool result) is ``=<answer>`` and
    the policy ended it itself, else 0: a guess scores 0 unless it is right (1 in 1,000)."""
    if answer is None:
        raise ValueError("the lookup reward needs an 'answer' field in the data row")
    if finish_reason != "stop":
        return 0.0
    return 1.0 if tasks.final_answer(completion) == f"={answer}" else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m asyncrl.agents.demo_agent",
        description="Serve the agent demo's lookup tool over MCP (stdio).",
    )
    p.parse_args(argv)
    StdioServer("asyncrl-demo-lookup", "0.1.0", [LOOKUP]).serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
