"""The agent demo's old name, kept working: its tool and reward moved to
:mod:`asyncrl.agents.demo_agent` (issue #47), but a recipe a user already wrote names
``rollout.tools: ["mcp:stdio:python -m asyncrl.demo_agent"]`` and ``rollout.reward:
asyncrl.demo_agent:reward``, and a worker runs the first per episode: both still work, the same
objects as the new module's."""

from asyncrl.agents.demo_agent import LOOKUP, lookup, main, reward

__all__ = ["LOOKUP", "lookup", "main", "reward"]

if __name__ == "__main__":
    raise SystemExit(main())
