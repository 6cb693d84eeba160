"""Tool environments: MCP servers started here (tests/mcp_server.py) over stdio and streamable
HTTP, a hung tool cut at its timeout and a crashed server reported, both followed by calls that
work; the chat template's tool role; and a real rollout whose fitted model calls an MCP tool."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from asyncrl.agents.tool_envs import (
    MCPServer,
    MCPToolingEnv,
    ToolSet,
    opened,
    split_tool_specs,
)
from asyncrl.agents.tools import ToolCall, ToolRegistry
from asyncrl.plugins import PluginError

pytest.importorskip("mcp")

SERVER = Path(__file__).resolve().parents[1] / "mcp_server.py"


def stdio_server(*extra: str) -> MCPServer:
    return MCPServer(command=(sys.executable, str(SERVER), "stdio", *extra))


@pytest.fixture(scope="module")
def http_url():
    with socket.socket() as s:  # listening before the server starts: no port to find free
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cmd = [sys.executable, str(SERVER), "http", str(s.fileno())]
        proc = subprocess.Popen(
            cmd, pass_fds=[s.fileno()], stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL
        )
    yield f"http://127.0.0.1:{port}/mcp"  # a request waits in the socket's backlog until it serves
    proc.terminate()
    proc.wait(10)


def test_mcp_specs_parse_and_bad_ones_name_the_field():
    local, servers = split_tool_specs(
        ["m:f", "mcp:stdio:python -m srv --x 'a b'", "mcp:http://127.0.0.1:9/mcp"]
    )
    assert local == ["m:f"]
    assert servers == [
        MCPServer(command=("python", "-m", "srv", "--x", "a b")),
        MCPServer(url="http://127.0.0.1:9/mcp"),
    ]
    for bad in ["mcp:ftp://x", "mcp:stdio:", "mcp:stdio:'unclosed"]:
        with pytest.raises(PluginError, match=r"rollout\.tools\[3\]"):
            split_tool_specs(["a:b", "c:d", "e:f", bad])


def _env_behaviour(server: MCPServer) -> None:
    """add works; a hung call is cut at the timeout and the next call works on a new session; a
    crashed server is an error result, and the next call works again."""

    async def go():
        stats: dict[str, int] = {}
        env = MCPToolingEnv([server], timeout_s=1.5, stats=stats)
        with trio.fail_after(120):
            await body(env, stats)

    async def body(env: MCPToolingEnv, stats: dict[str, int]) -> None:
        async with opened(env):
            names = {s["function"]["name"] for s in env.list_tools()}
            assert names == {"add", "sleep_forever", "crash"}
            r = await env.execute(ToolCall(name="add", arguments={"a": 2, "b": 3}))
            assert (r.ok, r.text) == (True, "5")
            t0 = trio.current_time()
            r = await env.execute(ToolCall(name="sleep_forever", arguments={}))
            assert not r.ok and r.timed_out and "timed out after 1.5s" in r.text
            assert 1.5 <= trio.current_time() - t0 < 10
            r = await env.execute(ToolCall(name="add", arguments={"a": 1, "b": 1}))
            assert (r.ok, r.text) == (True, "2")
            if server.command:  # a crash kills the stdio server; an HTTP server's is shared
                r = await env.execute(ToolCall(name="crash", arguments={}))
                assert not r.ok and r.text.startswith("error: crash")
                r = await env.execute(ToolCall(name="add", arguments={"a": 4, "b": 4}))
                assert (r.ok, r.text) == (True, "8")
            r = await env.execute(ToolCall(name="nope", arguments={}))
            assert r.text == "error: no tool named 'nope' (tools: add, sleep_forever, crash)"
        assert stats["timeouts"] == 1 and stats["session_restarts"] >= 1

    trio.run(go)  # the mcp client (anyio) on trio, as in the worker


def test_mcp_over_stdio_on_trio():
    _env_behaviour(stdio_server())


def test_mcp_over_streamable_http(http_url):
    _env_behaviour(MCPServer(url=http_url))


def test_a_server_that_does_not_start_is_an_error_not_a_hang(tmp_path):
    env = MCPToolingEnv([MCPServer(command=(sys.executable, "-c", "pass"))], connect_timeout_s=20)

    async def go():
        with trio.fail_after(60):
            with pytest.raises(RuntimeError, match="MCP server"):
                await env.initialise()

    trio.run(go)


# ---- the chat template's tool role -----------------------------------------------------------------


def test_tool_result_tokens_are_the_templates_tool_turn(tiny_qwen3_chat):
    """prompt + generated turn + the tool-turn delta is exactly the template's rendering of the whole
    conversation up to the next assistant turn, whether the turn ended with the template's end token
    (Qwen3's EOS is <|im_end|>) or not (a stop string, or an EOS the template does not write)."""
    from transformers import AutoTokenizer

    from asyncrl.rollout.workflows import chat_tool_turn
    from tests.tool_caller import ANSWER, CHAT, TOOLS

    tok = AutoTokenizer.from_pretrained(tiny_qwen3_chat)
    # as in Qwen3's own tokenizer, the template's markers are special tokens
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    end = tok.convert_tokens_to_ids("<|im_end|>")
    prompt = tok.apply_chat_template(CHAT, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    whole = tok.apply_chat_template(
        CHAT + [{"role": "assistant", "content": ANSWER}, {"role": "tool", "content": "5"}],
        tools=TOOLS,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert whole.startswith(prompt)
    expected = tok.encode(whole[len(prompt) :], add_special_tokens=False)
    answer = tok.encode(ANSWER, add_special_tokens=False)
    for generated in [answer + [end], answer]:
        delta = tok.encode(chat_tool_turn(tok, "5", generated[-1]), add_special_tokens=False)
        assert generated + delta == expected
    assert tok.decode(delta).startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n")
    assert tok.decode(delta).endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_a_template_that_does_not_show_tool_messages_is_refused():
    """MultiTurn then falls back to plain-text results instead of silently dropping them."""
    from asyncrl.rollout.workflows import chat_tool_turn

    class NoToolRole:
        all_special_ids: list[int] = []

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            return "".join(m["content"] + "|" for m in messages if m["role"] != "tool") + "gen:"

    with pytest.raises(ValueError, match="does not show tool messages"):
        chat_tool_turn(NoToolRole(), "5", None)


# ---- a real rollout: the fitted tool caller calls the MCP server's add --------------------------------


@pytest.fixture(scope="module")
def mcp_schemas():
    async def go():
        async with opened(MCPToolingEnv([stdio_server()])) as env:
            return env.list_tools()

    return trio.run(go)


@pytest.fixture(scope="module")
def mcp_engine(tiny_qwen3_chat, tmp_path_factory, mcp_schemas):
    from asyncrl.engine import EngineConfig, serve
    from tests.tool_caller import fit_tool_caller

    folder = fit_tool_caller(tiny_qwen3_chat, tmp_path_factory.mktemp("mcp_caller"), mcp_schemas)
    srv = serve(EngineConfig(model=str(folder), max_batch_size=8))
    yield srv, folder
    srv.stop()


def _rollout(engine, folder, tool_set: ToolSet, n: int):
    from transformers import AutoTokenizer

    from asyncrl.rollout.generator_pool import GeneratorPool
    from asyncrl.rollout.prompts import render_prompt
    from asyncrl.rollout.sglang_protocol import SamplingParams
    from asyncrl.rollout.workflows import EpisodeContext, MultiTurn, play
    from tests.tool_caller import CHAT

    tok = AutoTokenizer.from_pretrained(folder)

    async def go():
        schemas = await tool_set.schemas()
        row = {"prompt": CHAT}
        text, ids = render_prompt(row, tok, chat_template=True, tools=schemas)
        eps = []
        async with GeneratorPool([engine.url]) as pool:
            await pool.label()  # the engine's "default" version is 0
            for i in range(n):  # one after another: each after the last one's tool trouble
                ctx = EpisodeContext(
                    prompt_ids=ids,
                    prompt_text=text,
                    row=row,
                    pool=pool,
                    params=SamplingParams(max_new_tokens=320, temperature=0.0),
                    tokenizer=tok,
                    tools=tool_set.registry,
                    max_turns=2,
                    rid=f"mcp{i}",
                    tool_set=tool_set,
                    chat_template=True,
                )
                with trio.fail_after(120):
                    eps.append(await play(MultiTurn(), ctx))
        return tok, eps

    return trio.run(go)


def test_a_rollout_calls_the_mcp_servers_tool(mcp_engine):
    engine, folder = mcp_engine
    tool_set = ToolSet(ToolRegistry([], timeout_s=10.0), [stdio_server()])
    tok, (ep,) = _rollout(engine, folder, tool_set, 1)
    assert [(c["name"], c["ok"]) for c in ep.metadata["tool_calls"]] == [("add", True)]
    assert ep.metadata["turns"] == 2  # and it generated again after the result
    text = tok.decode(ep.completion_ids, skip_special_tokens=False)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>" in text
    ids = [t for t, m in zip(ep.completion_ids, ep.loss_mask, strict=True) if not m]
    masked = tok.decode(ids, skip_special_tokens=False)
    assert "<tool_response>\n5\n</tool_response>" in masked and "<tool_call>" not in masked


def test_a_hung_mcp_tool_is_cut_and_recorded_and_rollouts_go_on(mcp_engine):
    engine, folder = mcp_engine
    tool_set = ToolSet(ToolRegistry([], timeout_s=2.0), [stdio_server("--add", "hang")])
    tok, eps = _rollout(engine, folder, tool_set, 2)
    for ep in eps:
        (call,) = ep.metadata["tool_calls"]
        assert call["name"] == "add" and not call["ok"] and call["timed_out"]
        assert 2.0 <= call["seconds"] < 10
        text = tok.decode(ep.completion_ids, skip_special_tokens=False)
        assert "<tool_response>\nerror: add timed out after 2s\n</tool_response>" in text
    assert tool_set.stats["timeouts"] == 2


def test_a_worker_with_a_hanging_mcp_tool_keeps_delivering_groups(mcp_engine):
    """The worker on trio, its recipe's tools an MCP server whose add hangs: every call is cut at
    the timeout, recorded in the sample and counted, and the worker delivers group after group."""
    from transformers import AutoTokenizer

    from asyncrl.buffer.client import BufferClient
    from asyncrl.rewards import RewardRunner, load_reward
    from asyncrl.rollout.generator_pool import GeneratorPool
    from asyncrl.rollout.prompts import PromptSource
    from asyncrl.rollout.sglang_protocol import SamplingParams
    from asyncrl.rollout.worker import RolloutWorker
    from asyncrl.rollout.worker_config import WorkerConfig
    from asyncrl.rollout.workflows import MultiTurn
    from asyncrl.wire import GeneratorInfo
    from tests.labels import set_label
    from tests.rollout.test_worker import serve_buffer, take_batch
    from tests.tool_caller import CHAT

    engine, folder = mcp_engine
    set_label(engine.url, "default")
    tool_set = ToolSet(ToolRegistry([], timeout_s=2.0), [stdio_server("--add", "hang")])
    rows = [{"prompt": CHAT, "answer": "5"}] * 4

    async def go(svc):
        async with (
            BufferClient(svc.address, worker_id="w0", timeout_s=2.0) as buffer,
            GeneratorPool([engine.url]) as pool,
        ):
            w = RolloutWorker(
                WorkerConfig(
                    worker_id="w0",
                    group_size=2,
                    max_concurrent_groups=1,
                    max_staleness=0,
                    max_groups=2,
                    chat_template=True,
                ),
                buffer=buffer,
                pool=pool,
                source=PromptSource(rows, name="rows.jsonl", seed=0),
                tokenizer=AutoTokenizer.from_pretrained(folder),
                workflow=MultiTurn(),
                reward=RewardRunner(load_reward("exact_match"), timeout_s=10.0),
                params=SamplingParams(max_new_tokens=320, temperature=0.0),
                tools=tool_set,
                max_turns=2,
                generators=[GeneratorInfo(url=engine.url, kind="builtin")],
            )
            with trio.fail_after(240):
                await w.run()
            return await take_batch(svc), dict(w.stats.counters)

    with serve_buffer(groups_per_batch=2, max_staleness=0) as svc:
        groups, counters = trio.run(go, svc)
    assert len(groups) == 2 and counters["groups_delivered"] >= 2
    for g in groups:
        for s in g.samples:
            (call,) = s.metadata["tool_calls"]
            assert call["name"] == "add" and call["timed_out"] and not call["ok"]
    assert counters["tool_timeouts"] == counters["tool_calls"] >= 4
    assert counters["tool_errors"] == counters["tool_calls"]
    assert counters["tool_call_episodes"] == 0  # a call cut at its timeout is not a valid one


def test_held_out_evaluation_runs_the_mcp_servers_tools(mcp_engine):
    """Evaluation goes the rollout's way: the MCP server's tools in the prompt and in the episode."""
    from transformers import AutoTokenizer

    from asyncrl.rewards import RewardRunner, load_reward
    from asyncrl.rollout.held_out_eval import Evaluation
    from asyncrl.rollout.sglang_protocol import SamplingParams
    from asyncrl.rollout.workflows import MultiTurn
    from tests.labels import set_label
    from tests.tool_caller import CHAT

    engine, folder = mcp_engine
    tool_set = ToolSet(ToolRegistry([], timeout_s=2.0), [stdio_server("--add", "hang")])
    evaluation = Evaluation(
        rows=[{"prompt": CHAT, "answer": "5"}],
        tokenizer=AutoTokenizer.from_pretrained(folder),
        workflow=MultiTurn(),
        reward=RewardRunner(load_reward("exact_match"), timeout_s=10.0),
        params=SamplingParams(max_new_tokens=320, temperature=0.0),
        tools=tool_set.registry,
        tool_set=tool_set,
        chat_template=True,
        max_turns=2,
    )
    set_label(engine.url, "0")  # evaluation asks only generators that say which version they hold
    try:
        report = evaluation.run([engine.url], version=0, timeout_s=120)
    finally:
        set_label(engine.url, "default")
    assert report.failed == 0 and report.other_version == 0
    (example,) = report.examples
    assert "error: add timed out after 2s" in example["completion"]
    assert tool_set.stats["timeouts"] == 1
    # the call was made but not answered: no valid tool call, and the rate says so
    assert report.tool_call_rate == 0.0 and report.metrics()["eval/tool_call_rate"] == 0.0
