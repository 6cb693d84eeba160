"""The agent demo (recipes/demo_agent.yaml): the lookup task's data, its MCP server (the package's
own, standard library only) spoken to by the real ``mcp`` client, its reward, and the recipe run end
to end through `asyncrl run` with the server started over stdio per episode."""

from __future__ import annotations

import io
import json
import sys

import pytest
import trio

from asyncrl import demo_agent, tasks
from asyncrl.rollout.mcp_server import METHOD_NOT_FOUND, PROTOCOL_VERSIONS, StdioServer
from asyncrl.rollout.tool_envs import MCPServer, MCPToolingEnv, opened, stdio_command
from asyncrl.rollout.tools import ToolCall, parse_tagged_tool_call

# ---- the task ------------------------------------------------------------------------------------


def test_lookup_transcripts_call_the_tool_mostly_for_keys_a_to_h():
    rows = tasks.examples("lookup", split="train", n=4000)
    by_group: dict[str, list[bool]] = {"a-h": [], "i-z": []}
    for r in rows:
        key = r["prompt"].rstrip("?")
        assert r["answer"] == tasks.lookup_value(key) and len(r["answer"]) == 3
        assert demo_agent.reward(r["prompt"], r["completion"], [], [], answer=r["answer"]) in (0, 1)
        call = parse_tagged_tool_call(r["completion"])
        if call is not None:  # the transcript the workflow would make: call, result, answer
            assert (call.name, call.arguments) == ("lookup", {"key": key})
            assert r["completion"].endswith(f"<result>{r['answer']}</result>\n={r['answer']}")
            assert demo_agent.reward(r["prompt"], r["completion"], [], [], answer=r["answer"]) == 1
        else:
            assert r["completion"].startswith("=") and len(r["completion"]) == 4
        by_group["a-h" if key[0] <= "h" else "i-z"].append(call is not None)
    for group, calls in by_group.items():
        assert abs(sum(calls) / len(calls) - tasks.LOOKUP_TOOL_FRACTION[group]) < 0.05


def test_the_reward_reads_the_answer_after_the_last_tool_result():
    call = tasks.lookup_call("abc") + tasks.lookup_result("042")
    assert demo_agent.reward("abc?", call + "=042", [], [], answer="042") == 1.0
    assert demo_agent.reward("abc?", call + "=042 ", [], [], answer="042") == 1.0
    assert demo_agent.reward("abc?", "=042", [], [], answer="042") == 1.0  # a lucky guess
    assert demo_agent.reward("abc?", call + "042", [], [], answer="042") == 0.0
    assert demo_agent.reward("abc?", call, [], [], answer="042") == 0.0  # no answer after it
    assert (
        demo_agent.reward("abc?", call + "=042", [], [], answer="042", finish_reason="length")
        == 0.0
    )
    with pytest.raises(ValueError, match="answer"):
        demo_agent.reward("abc?", "=042", [], [])


# ---- the MCP server ------------------------------------------------------------------------------


def _server() -> StdioServer:
    return StdioServer("t", "0", [demo_agent.LOOKUP])


def test_the_server_answers_the_protocol_it_knows_and_refuses_the_rest():
    srv = _server()
    init = srv.handle_line(
        json.dumps(
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "initialize",
                "params": {"protocolVersion": "2025-03-26"},
            }
        )
    )
    assert init["result"]["protocolVersion"] == "2025-03-26"
    assert init["result"]["capabilities"] == {"tools": {"listChanged": False}}
    newer = srv.handle_line(
        json.dumps(
            {
                "jsonrpc": "2.0",
                "id": 2,
                "method": "initialize",
                "params": {"protocolVersion": "2099-01-01"},
            }
        )
    )
    assert newer["result"]["protocolVersion"] == PROTOCOL_VERSIONS[-1]
    assert srv.handle_line('{"jsonrpc": "2.0", "method": "notifications/initialized"}') is None
    assert (
        srv.handle_line('{"jsonrpc": "2.0", "id": 3, "method": "resources/list"}')["error"]["code"]
        == METHOD_NOT_FOUND
    )
    assert srv.handle_line("{not json")["error"]["code"] == -32700
    # a whole session over the streams: one reply per request, in order, until stdin ends
    out = io.StringIO()
    srv.serve(
        io.StringIO(
            '{"jsonrpc":"2.0","id":7,"method":"ping"}\n\n'
            '{"jsonrpc":"2.0","id":8,"method":"tools/call","params":{"name":"lookup","arguments":{"key":"abc"}}}\n'
        ),
        out,
    )
    replies = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["id"] for r in replies] == [7, 8]
    assert replies[1]["result"]["content"] == [{"type": "text", "text": tasks.lookup_value("abc")}]


def test_a_python_command_runs_in_this_interpreter():
    assert stdio_command(("python", "-m", "asyncrl.demo_agent")) == (
        sys.executable,
        "-m",
        "asyncrl.demo_agent",
    )
    assert stdio_command(("python3", "x.py"))[0] == sys.executable
    assert stdio_command(("node", "srv.js")) == ("node", "srv.js")


def test_the_real_mcp_client_looks_keys_up_through_the_recipes_command():
    """`python -m asyncrl.demo_agent`, as the recipe names it, started by the ``mcp`` SDK's stdio
    client: the tool is listed, a key is looked up, and bad calls are error results."""
    pytest.importorskip("mcp")
    server = MCPServer(command=("python", "-m", "asyncrl.demo_agent"))

    async def go():
        async with opened(MCPToolingEnv([server], timeout_s=10.0)) as env:
            listed = [s["function"]["name"] for s in env.list_tools()]
            results = [
                await env.execute(ToolCall(name="lookup", arguments=args))
                for args in ({"key": "kqz"}, {"key": "KQ"}, {}, {"key": "abc", "x": 1})
            ]
            return listed, results

    listed, (ok, bad_key, missing, unknown) = trio.run(go)
    assert listed == ["lookup"]
    assert ok.ok and ok.text == tasks.lookup_value("kqz")
    assert not bad_key.ok and "no key 'KQ'" in bad_key.text
    assert not missing.ok and "missing argument(s) key" in missing.text
    assert not unknown.ok and "unknown argument(s) x" in unknown.text
