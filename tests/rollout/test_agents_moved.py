"""The agents' old import paths (asyncrl.rollout.tools and its siblings, before issue #47 gave the
agents a room of their own) fail with one line naming the new one; the agent demo's old name,
``asyncrl.demo_agent``, which recipes name (``python -m`` and ``:reward``), still works."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MOVED = ["tools", "tool_envs", "mcp_server", "recording", "proxy"]


@pytest.mark.parametrize("name", MOVED)
def test_the_old_path_names_the_new_one(name: str) -> None:
    old, new = f"asyncrl.rollout.{name}", f"asyncrl.agents.{name}"
    with pytest.raises(ImportError, match=f"^{old} moved to {new}: import {new} instead$"):
        importlib.import_module(old)
    importlib.import_module(new)


def test_a_plugin_on_the_old_path_fails_with_one_line_naming_the_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncrl.plugins import PluginError
    from asyncrl.rollout.workflows import load_workflow

    (tmp_path / "old_agent.py").write_text(
        "from asyncrl.rollout.recording import AgentWorkflow\n"
        "async def agent(client, row):\n    return 1.0\n"
        "workflow = AgentWorkflow(agent)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError) as e:
        load_workflow("old_agent:workflow")
    (line,) = str(e.value).splitlines()
    assert "asyncrl.rollout.recording moved to asyncrl.agents.recording" in line


def test_the_demo_agents_old_name_is_the_new_module() -> None:
    from asyncrl import demo_agent
    from asyncrl.agents import demo_agent as new
    from asyncrl.rewards import load_reward

    assert demo_agent.reward is new.reward and demo_agent.LOOKUP is new.LOOKUP
    assert load_reward("asyncrl.demo_agent:reward") is new.reward


def test_python_m_of_the_demo_agents_old_name_serves_the_tool() -> None:
    hello = '{"jsonrpc":"2.0","id":1,"method":"tools/list"}\n'
    p = subprocess.run(
        [sys.executable, "-m", "asyncrl.demo_agent"],
        cwd=ROOT,
        input=hello,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert [t["name"] for t in json.loads(p.stdout)["result"]["tools"]] == ["lookup"]
