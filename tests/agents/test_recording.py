"""The recording OpenAI client: trajectory assembly (pure) and an agent's three turns on the built-in
engine with the fitted tool caller (tests/tool_caller.py)."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import trio

from asyncrl.agents.recording import AgentWorkflow, Trajectory, TrajectoryMismatch
from asyncrl.agents.tools import ToolRegistry
from asyncrl.rollout.generator_pool import Completion, GeneratorPool
from asyncrl.rollout.sglang_protocol import SamplingParams
from asyncrl.rollout.turns import turn_of
from asyncrl.rollout.workflows import EpisodeContext, play
from tests.tool_caller import CHAT, TOOLS


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def completion(text: str, *, stop: int | None = None, version: int = 3) -> Completion:
    ids = chars(text) + ([] if stop is None else [stop])
    return Completion(
        output_ids=ids,
        logprobs=[-0.5] * len(ids),
        versions=[version] * len(ids),
        finish_reason="stop" if stop is not None else "length",
        matched_stop=stop,
    )


# -- pure trajectory assembly ----------------------------------------------------------------------


def test_turns_join_into_one_sequence_with_the_models_tokens_masked_in():
    t = Trajectory()
    assert t.next_prompt("U:hi\nA:", chars) == chars("U:hi\nA:")
    t.add(t.prompt_ids, completion("call", version=1), "call")
    p2 = t.next_prompt("U:hi\nA:call\nT:42\nA:", chars)
    assert p2 == chars("U:hi\nA:call\nT:42\nA:")
    t.add(p2, completion("done", version=2), "done")
    ep = t.to_episode(reward=0.5)
    ep.check()
    assert ep.prompt_ids == chars("U:hi\nA:") and ep.reward == 0.5
    assert ep.completion_ids == chars("call\nT:42\nA:done")
    assert ep.loss_mask == [1] * 4 + [0] * 8 + [1] * 4
    assert ep.logprobs == [-0.5] * 4 + [0.0] * 8 + [-0.5] * 4
    assert ep.versions == [1] * 4 + [1] * 8 + [2] * 4  # template tokens carry the version before
    assert ep.metadata["turns"] == 2 and ep.finish_reason == "length"


def test_a_rendering_that_does_not_extend_the_conversation_raises():
    t = Trajectory()
    t.next_prompt("U:hi\nA:", chars)
    t.add(t.prompt_ids, completion("<think>x</think>ok"), "<think>x</think>ok")
    with pytest.raises(TrajectoryMismatch, match="part at character 7"):
        t.next_prompt("U:hi\nA:ok\nU:more\nA:", chars)  # the template dropped the thinking


def test_a_stop_token_the_template_does_not_render_is_dropped():
    t = Trajectory()
    t.next_prompt("U:hi\nA:", chars)
    t.add(t.prompt_ids, completion("call", stop=0), "call<eos>", without_stop="call")
    p2 = t.next_prompt("U:hi\nA:call<end>\nA:", chars)
    assert p2 == chars("U:hi\nA:call<end>\nA:")  # the model's <eos> is not in what it sees next
    ep = t.to_episode()
    assert ep.loss_mask == [1] * 4 + [0] * 8 and ep.metadata["dropped_stop_tokens"] == 1


def test_a_stop_token_the_template_renders_is_kept():
    t = Trajectory()
    t.next_prompt("U:hi\nA:", chars)
    t.add(t.prompt_ids, completion("call", stop=ord("$")), "call$", without_stop="call")
    t.next_prompt("U:hi\nA:call$\nA:", chars)
    ep = t.to_episode()
    assert ep.completion_ids == chars("call$\nA:") and ep.loss_mask == [1] * 5 + [0] * 3
    assert "dropped_stop_tokens" not in ep.metadata


def test_no_call_is_no_episode():
    with pytest.raises(ValueError, match="no chat.completions.create"):
        Trajectory().to_episode()


# -- on the built-in engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tool_caller_dir):
    from transformers import AutoTokenizer

    from asyncrl.engine import EngineConfig, serve

    srv = serve(EngineConfig(model=str(tool_caller_dir), max_batch_size=8))
    yield srv, AutoTokenizer.from_pretrained(tool_caller_dir)
    srv.stop()


async def three_turns(client, row):
    """model (tool call) -> tool -> model, as an agent on the OpenAI API writes it."""
    messages: list = list(CHAT)
    r = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    messages.append(choice.message)  # the pydantic message, passed back as agents do
    messages.append({"role": "tool", "tool_call_id": call.id, "content": str(sum(args.values()))})
    r = await client.chat.completions.create(
        model="m", messages=messages, tools=TOOLS, max_tokens=6
    )
    row["final_messages"] = messages
    row["last_ids"] = r.choices[0].response_token_ids
    return 1.0


def run(srv, tok, workflow, row):
    async def go():
        async with GeneratorPool([srv.url]) as pool:
            await pool.label()
            ctx = EpisodeContext(
                prompt_ids=[1],
                prompt_text="",
                row=row,
                pool=pool,
                params=SamplingParams(max_new_tokens=200, temperature=0.0),
                tokenizer=tok,
                tools=ToolRegistry([]),
                max_turns=4,
                rid="rec",
            )
            return await play(workflow, ctx)

    return trio.run(go)


def test_three_turns_make_one_sample_of_the_templates_tokens(served):
    srv, tok = served
    row: dict = {}
    ep = run(srv, tok, AgentWorkflow(three_turns), row)
    assert ep.reward == 1.0 and ep.metadata["turns"] == 2

    # the ids are the chat template's rendering of the whole conversation + the last completion
    final = [
        m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in row["final_messages"]
    ]
    text = tok.apply_chat_template(final, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    first = tok.apply_chat_template(CHAT, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    rendered = tok.encode(text, add_special_tokens=False)
    assert ep.prompt_ids == tok.encode(first, add_special_tokens=False)
    assert ep.prompt_ids + ep.completion_ids == rendered + row["last_ids"]

    # the loss mask covers exactly the model's tokens: its first turn (its <eos> dropped: this
    # template ends the turn with <|im_end|>) and its last
    answer = tok.encode(
        'Adding.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
        add_special_tokens=False,
    )
    n_mid = len(rendered) - len(ep.prompt_ids) - len(answer)
    assert ep.loss_mask == [1] * len(answer) + [0] * n_mid + [1] * len(row["last_ids"])
    assert ep.metadata["dropped_stop_tokens"] == 1
    assert set(ep.versions) == {0}

    # the logprobs are the engine's for those tokens: /generate again on each call's prompt
    mine = [lp for lp, m in zip(ep.logprobs, ep.loss_mask, strict=True) if m]
    ref = []
    for prompt, want in ((ep.prompt_ids, answer), (rendered, row["last_ids"])):
        body = httpx.post(
            srv.url + "/generate",
            json={
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": len(want), "temperature": 0.0},
                "return_logprob": True,
            },
            timeout=60,
        ).json()
        assert body["output_ids"] == want
        ref += [x[0] for x in body["meta_info"]["output_token_logprobs"]]
    assert mine == pytest.approx(ref, abs=1e-5)


# -- proxy mode: the same agent over HTTP ----------------------------------------------------------


def three_turns_over_http(endpoint, row):
    """The agent of three_turns in another thread (as another process would), on the sync client."""
    import openai

    client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, timeout=120)
    messages: list = list(CHAT)
    r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    (call,) = r.choices[0].message.tool_calls
    messages.append(r.choices[0].message.model_dump(exclude_none=True))
    args = json.loads(call.function.arguments)
    messages.append({"role": "tool", "tool_call_id": call.id, "content": str(sum(args.values()))})
    r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=6)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=endpoint.base_url, api_key="wrong").models.list()
    with pytest.raises(openai.BadRequestError, match="does not extend"):  # history edited
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    return 0.25


def test_an_agent_over_http_makes_the_same_sample(served):
    from asyncrl.agents.proxy import ProxyAgentWorkflow

    async def agent(endpoint, row):
        return await trio.to_thread.run_sync(three_turns_over_http, endpoint, row)

    srv, tok = served
    direct = run(srv, tok, AgentWorkflow(three_turns), {})
    proxied = run(srv, tok, ProxyAgentWorkflow(agent), {})
    assert proxied.reward == 0.25 and proxied.metadata["turns"] == 2  # the failed call is no turn
    assert proxied.prompt_ids == direct.prompt_ids
    assert proxied.completion_ids == direct.completion_ids
    assert proxied.loss_mask == direct.loss_mask
    assert proxied.logprobs == pytest.approx(direct.logprobs, abs=1e-5)


def test_a_mismatched_call_changes_nothing():
    t = Trajectory()
    t.next_prompt("U:hi\nA:", chars)
    t.add(t.prompt_ids, completion("ok", stop=0), "ok<eos>", without_stop="ok")
    with pytest.raises(TrajectoryMismatch):
        t.next_prompt("U:bye\nA:", chars)
    assert t.next_prompt("U:hi\nA:ok<eos>U:x\nA:", chars) == chars("U:hi\nA:ok") + [0] + chars(
        "U:x\nA:"
    )


def make_group(srv, tok, **config):
    """One group of the recipe-named agent through the worker's group maker."""
    from asyncrl.rewards import RewardRunner, load_reward
    from asyncrl.rollout.group_maker import GroupMaker
    from asyncrl.rollout.prompts import PromptSource
    from asyncrl.rollout.worker_config import WorkerConfig
    from asyncrl.rollout.worker_stats import WorkerStats
    from asyncrl.rollout.workflows import load_workflow

    rows = [{"prompt": "unused", "question": CHAT[0]["content"]}]

    async def go():
        async with GeneratorPool([srv.url]) as pool:
            await pool.label()
            maker = GroupMaker(
                WorkerConfig(worker_id="w", group_size=2, **config),
                pool=pool,
                source=PromptSource(rows, name="rows", seed=0),
                tokenizer=tok,
                workflow=load_workflow("tests.rollout_plugins:add_agent_workflow"),
                reward=RewardRunner(load_reward("exact_match"), timeout_s=10),
                params=SamplingParams(max_new_tokens=200, temperature=0.0),
                tools=ToolRegistry([]),
                max_turns=4,
                stats=WorkerStats(),
            )
            return await maker.make("g0", "lease0", await maker.take_prompt())

    return trio.run(go)


def test_an_agent_named_in_a_recipe_makes_groups_of_its_samples(served):
    """Through the worker's group maker: the sample's prompt is the agent's first rendered chat
    (not the row's prompt) and its reward the agent's."""
    srv, tok = served
    first = tok.apply_chat_template(CHAT, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    group = make_group(srv, tok)
    assert len(group.samples) == 2
    for s in group.samples:
        assert s.reward == 1.0 and s.metadata["turns"] == 2
        assert s.prompt_ids.tolist() == tok.encode(first, add_special_tokens=False)
        assert len(s.completion_ids) == len(s.loss_mask) == len(s.behavior_logprobs)
        assert 0 < s.loss_mask.sum() < len(s.loss_mask)


def test_each_turn_its_own_sample_with_the_reward_discounted_per_turn(served):
    """``rollout.turn_samples``: each model turn is a sample whose prompt is exactly the
    conversation the engine saw for that call, with the trajectory's tokens, logprobs and versions
    split between them; the reward is γ^(turns after it)·R."""
    srv, tok = served
    whole = make_group(srv, tok).samples  # temperature 0: the same conversations
    turns = make_group(srv, tok, turn_samples=True, turn_discount=0.5).samples
    assert len(turns) == 2 * len(whole)
    for k, w in enumerate(whole):
        a, b = turns[2 * k], turns[2 * k + 1]
        assert (a.id, b.id) == (f"{w.id}.0", f"{w.id}.1")
        assert (a.reward, b.reward) == (0.5 * w.reward, w.reward) == (0.5, 1.0)
        assert a.loss_mask.all() and b.loss_mask.all()
        assert a.prompt_ids.tolist() == w.prompt_ids.tolist()
        # turn 2's prompt: the first turn and the template/tool tokens after it
        gap = len(b.prompt_ids) - len(w.prompt_ids) - len(a.completion_ids)
        assert gap > 0 and w.loss_mask[len(a.completion_ids) :][:gap].sum() == 0
        joined = np.concatenate([b.prompt_ids, b.completion_ids])
        assert joined.tolist() == np.concatenate([w.prompt_ids, w.completion_ids]).tolist()
        trained = w.loss_mask > 0
        for name in ("completion_ids", "versions"):
            both = np.concatenate([getattr(a, name), getattr(b, name)])
            assert both.tolist() == getattr(w, name)[trained].tolist()
        # the engine's logprobs (another run: batched differently, so equal to rounding)
        both = np.concatenate([a.behavior_logprobs, b.behavior_logprobs])
        assert both == pytest.approx(w.behavior_logprobs[trained], abs=1e-5)
        # the trajectory's finish reason on every turn (a cut trajectory is cut for all its turns)
        assert a.finish_reason == b.finish_reason == w.finish_reason
        assert turn_of(a) == (w.id, 0, 2) and turn_of(b) == (w.id, 1, 2)


def test_text_between_turns_past_the_budget_is_cut():
    t = Trajectory()
    t.next_prompt("U:hi\nA:", chars)
    t.add(t.prompt_ids, completion("ab"), "ab")
    t.next_prompt("U:hi\nA:ab\nT:a long tool result\nA:", chars)
    t.add(t.prompt_ids, completion(""), "")  # no room was left: nothing generated
    ep = t.to_episode(budget=6)
    assert ep.completion_ids == chars("ab\nT:a") and ep.loss_mask == [1, 1, 0, 0, 0, 0]
    assert ep.finish_reason == "length"


def test_proxy_routes_answer_in_openais_error_shape():
    from types import SimpleNamespace

    from asyncrl.agents.proxy import _route

    async def create(**req):
        if req.get("messages") == "boom":
            raise RuntimeError("no generator answered")
        raise TrajectoryMismatch("they part")

    fake = SimpleNamespace(create=create, ctx=SimpleNamespace(rid="g/0"))

    def route(method, path, body=b"{}", auth="Bearer k"):
        return trio.run(_route, fake, "k", method, path, auth, body)

    assert route("POST", "/v1/chat/completions", auth="Bearer x")[0] == 401
    assert route("POST", "/v1/completions")[0] == 404
    status, body = route("POST", "/v1/chat/completions", b"[1]")
    assert status == 400 and "JSON object" in body["error"]["message"]
    assert route("POST", "/v1/chat/completions", b"{not json")[0] == 400
    status, body = route("POST", "/v1/chat/completions", b'{"messages": []}')
    assert status == 400 and body["error"]["message"] == "TrajectoryMismatch: they part"
    status, body = route("POST", "/v1/chat/completions", b'{"messages": "boom"}')
    assert status == 500 and body["error"]["type"] == "InternalServerError"
