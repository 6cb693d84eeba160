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
from asyncrl.agents.mcp_server import METHOD_NOT_FOUND, PROTOCOL_VERSIONS, StdioServer
from asyncrl.agents.tool_envs import MCPServer, MCPToolingEnv, opened, stdio_command
from asyncrl.agents.tools import ToolCall, parse_tagged_tool_call

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
    bad = [
        '{"jsonrpc": "2.0", "id": 4, "method": "tools/call", "params": [1]}',
        '{"jsonrpc": "2.0", "id": 5, "method": "tools/call", "params": {"name": "lookup", "arguments": 3}}',
    ]
    assert [srv.handle_line(b)["error"]["code"] for b in bad] == [-32602, -32602]
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
    assert stdio_command(("python", "-m", "asyncrl.agents.demo_agent")) == (
        sys.executable,
        "-m",
        "asyncrl.agents.demo_agent",
    )
    assert stdio_command(("python3", "x.py"))[0] == sys.executable
    assert stdio_command(("node", "srv.js")) == ("node", "srv.js")


def test_the_real_mcp_client_looks_keys_up_through_the_recipes_command():
    """`python -m asyncrl.agents.demo_agent`, as the recipe names it, started by the ``mcp`` SDK's stdio
    client: the tool is listed, a key is looked up, and bad calls are error results."""
    pytest.importorskip("mcp")
    server = MCPServer(command=("python", "-m", "asyncrl.agents.demo_agent"))

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


# ---- recipes/demo_agent.yaml end to end, at a tiny scale --------------------------------------------

KEYS = ["abc", "kqz", "hit", "vox"]


@pytest.fixture(scope="module")
def lookup_caller(tmp_path_factory):
    return _fit_lookup_caller(tmp_path_factory.mktemp("lookup_caller"))


def _fit_lookup_caller(out):
    """The demo's tiny model fitted to play the whole lookup transcript for KEYS under greedy
    decoding (call, result, answer): an agent that calls the tool, as the SFT stage makes one,
    in seconds instead of minutes."""
    from transformers import AutoTokenizer

    from tests.tool_caller import fit_greedy
    from tools.make_demo import model_config
    from tools.make_tiny_model import make_tiny_model

    src = make_tiny_model(out / "random", seed=0, **model_config("lookup"))
    tok = AutoTokenizer.from_pretrained(src)
    rows = []
    for key in KEYS:
        value = tasks.lookup_value(key)
        p = tok.encode(f"{key}?")
        c = tok.encode(tasks.lookup_call(key) + tasks.lookup_result(value) + f"={value}")
        rows.append((p, c + [tok.eos_token_id]))
    return fit_greedy(src, rows, out / "model", steps=600)


@pytest.mark.slow  # 31 s on 2 cores, 48-70 s under other agents' load (fit, run, 2 evaluations)
@pytest.mark.parametrize("turn_samples", [False, True], ids=["trajectory", "turns"])
def test_the_agent_recipe_runs_end_to_end_through_the_mcp_server(
    tmp_path, lookup_caller, turn_samples
):
    """`asyncrl run recipes/demo_agent.yaml` for 2 steps: every episode starts the recipe's MCP
    server over stdio, the model's tool calls reach it, and the calls are recorded: in the
    samples' counters, the rollout and held-out tool-call rates (metrics.jsonl and the W&B offline
    runs) and summary.json's tool_call_rate_start/_end. With ``rollout.turn_samples`` the learner
    trains each episode's turns (the tool call, the answer) as samples of their own."""
    pytest.importorskip("mcp")
    from pathlib import Path

    from asyncrl import launch, metric_names, metrics

    root = Path(__file__).resolve().parents[2]
    model = lookup_caller
    rows = [{"prompt": f"{k}?", "answer": tasks.lookup_value(k)} for k in KEYS]
    data = tasks.write_jsonl(tmp_path / "rows.jsonl", rows)
    ov = [
        f"model.path={model}",
        f"data.path={data}",
        f"data.eval_path={data}",  # the fitted keys: this checks the plumbing, not generalisation
        f"run.output_dir={tmp_path}",
        "run.steps=2",
        f"run.eval_prompts={len(KEYS)}",
        "rollout.group_size=2",
        "rollout.max_concurrent_groups=2",
        "buffer.groups_per_batch=2",
        "buffer.dynamic_sampling=false",  # a fitted model solves every prompt: equal rewards
        "learner.checkpoint_every=0",
        "generator.max_batch_size=16",
        "rollout.temperature=0.2",  # a barely fitted model: near its greedy transcripts
    ]
    if turn_samples:
        ov += ["rollout.turn_samples=true", "rollout.turn_discount=0.5"]
    s = launch.run(root / "recipes/demo_agent.yaml", ov, progress=False)
    run_dir = tmp_path / "demo_agent"
    assert s["outcome"] == "completed", (run_dir / "logs/learner.log").read_text()[-3000:]
    assert s["tool_call_rate_start"] == 1.0 and s["reward_start"] == 1.0
    assert s["tool_call_rate_end"] is not None and s["reward_end"] is not None
    evals = metrics.read_metrics(run_dir, process="eval")
    assert [e["step"] for e in evals] == [0, 2]
    assert evals[0][metric_names.EVAL_TOOL_CALL_RATE] == 1.0
    workers = [r for r in metrics.read_metrics(run_dir) if r["process"].startswith("worker")]
    counts = {  # counters since the worker's start: their last values
        k: max(r.get(f"rollout/{k}", 0) for r in workers)
        for k in ("tool_calls", "tool_errors", "tool_call_episodes", "episodes")
    }
    assert counts["episodes"] >= 8  # at least the 2 steps' 2 groups of 2
    # sampled, a call may come out malformed (an error result, counted); most of the fitted
    # model's calls are answered, and the episodes that made one are counted
    assert counts["tool_calls"] >= 8 and counts["tool_errors"] < counts["tool_calls"] / 2
    assert counts["episodes"] / 2 <= counts["tool_call_episodes"] <= counts["episodes"]
    assert any(metric_names.ROLLOUT_TOOL_CALL_RATE in r for r in workers)
    # 2 groups of 2 episodes per step: one sample each, or one per turn (1 or 2 turns each)
    steps = [r for r in metrics.read_metrics(run_dir, process="learner") if "loss" in r]
    seqs = [r["learner/sequences"] for r in steps]
    assert len(seqs) == 2
    if turn_samples:
        assert all(4 <= n <= 8 for n in seqs) and sum(seqs) > 8
    else:
        assert seqs == [4, 4]
    logged = {k for rec in metrics.read_metrics(run_dir) for k in rec}
    assert set(metric_names.READ_WHEN_TOOLS) <= logged
    # W&B (offline, read back) has the held-out tool-call rate next to the success
    (ev,) = [w for w in metrics.read_wandb_offline(run_dir) if w["job_type"] == "eval"]
    hist = [h for h in ev["history"] if metric_names.EVAL_TOOL_CALL_RATE in h]
    assert [h["step"] for h in hist] == [0, 2] and hist[0][metric_names.EVAL_TOOL_CALL_RATE] == 1.0


# ---- summary.json: the tool-call rates of models no generator evaluated ---------------------------


def test_a_run_without_generators_evaluates_its_models_tool_call_rates(tmp_path, monkeypatch):
    """An SFT stage (no generators): the end of the run evaluates the first and last model on an
    engine of its own; with the recipe's tools, summary.json and metrics.jsonl get their tool-call
    rates next to their success."""
    from pathlib import Path

    from asyncrl import metric_names, metrics, recipe, summary
    from asyncrl.rollout.held_out_eval import EvalReport

    root = Path(__file__).resolve().parents[2]
    r = recipe.load(root / "recipes/demo_agent_sft.yaml", check_files=False)
    evaluated: list[Path | None] = []

    def fake_eval(r, model_dir, *, run_dir):
        evaluated.append(model_dir)
        n = len(evaluated)  # the start model calls the tool for 1 prompt of 4, the end one for 3
        return EvalReport(version=0, score=0.25 * n, prompts=4, with_tools=True,
                          tool_call_episodes=2 * n - 1)  # fmt: skip

    monkeypatch.setattr(summary, "eval_held_out", fake_eval)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    s = summary.finish_run(r, run_dir=run_dir, outcome="completed", wall_seconds=1.0, status=None)
    assert len(evaluated) == 2
    assert (s["reward_start"], s["reward_end"]) == (0.25, 0.5)
    assert (s["tool_call_rate_start"], s["tool_call_rate_end"]) == (0.25, 0.75)
    line = json.loads(summary.summary_line(s))
    assert line["tool_call_rate_start"] == 0.25 and line["tool_call_rate_end"] == 0.75
    evals = metrics.read_metrics(run_dir, process="eval")
    assert [e[metric_names.EVAL_TOOL_CALL_RATE] for e in evals] == [0.25, 0.75]
    # a recipe without tools has no such keys
    plain = recipe.load(root / "recipes/demo_sft.yaml", check_files=False)
    monkeypatch.setattr(summary, "eval_held_out", lambda *a, **k: None)
    s = summary.finish_run(
        plain, run_dir=tmp_path / "plain", outcome="completed", wall_seconds=1.0, status=None
    )
    assert "tool_call_rate_start" not in s and "tool_call_rate_end" not in s


def test_the_agent_recipes_name_what_make_demo_agent_builds_and_the_packaged_server():
    from pathlib import Path

    from asyncrl import recipe
    from asyncrl.agents.tool_envs import split_tool_specs
    from asyncrl.rewards import load_reward

    root = Path(__file__).resolve().parents[2]
    for name in ("demo_agent_sft.yaml", "demo_agent.yaml"):
        r = recipe.load(root / "recipes" / name, check_files=False)
        data = r.resolve(r.data.path).resolve()
        assert data == (root / "build/demo_agent/data/train.jsonl").resolve()
        _, (server,) = split_tool_specs(r.rollout.tools)
        assert server.command == ("python", "-m", "asyncrl.agents.demo_agent")
        assert r.rollout.workflow == "multi_turn"
        assert load_reward(r.rollout.reward) is demo_agent.reward
