"""``/v1/chat/completions`` on the built-in engine, driven by the official ``openai`` client.

To make a tool call come out of the engine for real, the tests fit the tiny Qwen3 (with Qwen3's chat
template) for a few dozen Adam steps to answer one tool-declaring chat with a fixed text and a
``<tool_call>``, until greedy decoding reproduces it (tests/tool_caller.py); the engine then serves
that folder. This is
deterministic (greedy decode of a memorised answer; ~10 s on one core) and exercises the whole path:
template rendering with ``tools``, the scheduler, stop rules, the parser, the OpenAI shapes. Tests
that do not need the call use the same model on other chats, where it writes anything.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from asyncrl.engine import EngineConfig, serve
from tests.tool_caller import ANSWER, CHAT, TOOLS


@pytest.fixture(scope="module")
def caller_dir(tool_caller_dir) -> Path:
    return tool_caller_dir


@pytest.fixture(scope="module")
def engine(caller_dir):
    srv = serve(EngineConfig(model=str(caller_dir), max_batch_size=8))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", timeout=120)


@pytest.fixture(scope="module")
def model(engine) -> str:
    return engine.engine.served_name


def test_models(client, model):
    assert [m.id for m in client.models.list().data] == [model]


def test_a_tool_call_is_parsed_into_tool_calls(client, model, caller_dir):
    from transformers import AutoTokenizer

    r = client.chat.completions.create(model=model, messages=CHAT, tools=TOOLS, temperature=0)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.role == "assistant" and choice.message.content == "Adding."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    tok = AutoTokenizer.from_pretrained(caller_dir)
    prompt = tok.encode(
        tok.apply_chat_template(CHAT, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    )
    n_answer = len(tok.encode(ANSWER)) + 1  # and <eos>
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), n_answer)
    assert r.object == "chat.completion" and r.model == model


def test_a_streamed_tool_call(client, model):
    stream = client.chat.completions.create(
        model=model,
        messages=CHAT,
        tools=TOOLS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    first, usage = chunks[0], chunks[-1]
    assert first.choices[0].delta.role == "assistant"
    assert usage.choices == [] and usage.usage.completion_tokens > 0
    content, calls, reasons = "", [], []
    for c in chunks[:-1]:
        (ch,) = c.choices
        content += ch.delta.content or ""
        calls += ch.delta.tool_calls or []
        reasons.append(ch.finish_reason)
    assert content == "Adding." and reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}
    (call,) = calls
    assert call.index == 0 and call.id.startswith("call_") and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert len({c.id for c in chunks}) == 1


def test_n_streamed_choices_each_get_a_role_and_a_finish(client, model):
    stream = client.chat.completions.create(
        model=model, messages=CHAT, tools=TOOLS, temperature=0, n=2, stream=True
    )
    roles, reasons, calls = {}, {}, {0: [], 1: []}
    for c in stream:
        (ch,) = c.choices
        if ch.delta.role:
            roles[ch.index] = ch.delta.role
        if ch.finish_reason:
            reasons[ch.index] = ch.finish_reason
        calls[ch.index] += [t.function.name for t in ch.delta.tool_calls or []]
    assert roles == {0: "assistant", 1: "assistant"}
    assert reasons == {0: "tool_calls", 1: "tool_calls"} and calls == {0: ["add"], 1: ["add"]}


def test_tool_choice_none_hides_the_tools_and_parses_nothing(client, model):
    with_tools = client.chat.completions.create(
        model=model, messages=CHAT, tools=TOOLS, max_tokens=1, temperature=0
    )
    hidden = client.chat.completions.create(
        model=model, messages=CHAT, tools=TOOLS, tool_choice="none", max_tokens=1
    )
    plain = client.chat.completions.create(model=model, messages=CHAT, max_tokens=1)
    assert hidden.usage.prompt_tokens == plain.usage.prompt_tokens < with_tools.usage.prompt_tokens


def test_tool_choice_auto_without_a_call_leaves_the_text_alone(client, model):
    r = client.chat.completions.create(
        model=model, messages=CHAT, tools=TOOLS, temperature=0, stop=["<tool_call>"]
    )
    (choice,) = r.choices
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == "Adding.\n"
    assert choice.model_extra["matched_stop"] == "<tool_call>"


def test_stop_strings_are_never_streamed(client, model):
    kw = dict(model=model, messages=CHAT, tools=TOOLS, temperature=0, stop=["<tool_call>"])
    whole = client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
    )
    assert whole == streamed == "Adding.\n"


def test_max_tokens(client, model):
    for key in ("max_tokens", "max_completion_tokens"):
        r = client.chat.completions.create(
            model=model, messages=CHAT, tools=TOOLS, temperature=0, **{key: 3}
        )
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.content == "Add"
        assert r.usage.completion_tokens == 3


def test_n_choices_with_logprobs_match_generate(client, model, engine):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hello"}],
        n=2,
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        seed=7,
        extra_body={"return_token_ids": True},
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 8
    gen = httpx.post(
        engine.url + "/generate",
        json={
            "input_ids": r.choices[0].model_extra["prompt_token_ids"],
            "sampling_params": {"max_new_tokens": 4, "n": 2, "sampling_seed": 7},
            "return_logprob": True,
        },
        timeout=60,
    ).json()
    for choice, g in zip(r.choices, gen, strict=True):
        lps = choice.logprobs.content
        assert all(len(x.top_logprobs) == 2 and x.bytes == list(x.token.encode()) for x in lps)
        assert choice.model_extra["response_token_ids"] == g["output_ids"]
        want = [x[0] for x in g["meta_info"]["output_token_logprobs"]]
        assert [x.logprob for x in lps] == pytest.approx(want, abs=1e-5)


def test_streamed_logprobs_cover_every_token(client, model):
    stream = client.chat.completions.create(
        model=model, messages=CHAT, tools=TOOLS, temperature=0, logprobs=True, stream=True
    )
    lps = [x for c in stream for ch in c.choices if ch.logprobs for x in ch.logprobs.content]
    assert "".join(x.token for x in lps) == ANSWER + "<eos>"  # a token's text keeps specials


def test_token_ids_and_weight_versions_for_training(client, model, caller_dir):
    """What a recording client needs: exact prompt and completion ids, per-token versions."""
    from transformers import AutoTokenizer

    r = client.chat.completions.create(
        model=model,
        messages=CHAT,
        tools=TOOLS,
        temperature=0,
        extra_body={"return_token_ids": True, "return_meta_info": True},
    )
    extra = r.choices[0].model_extra
    tok = AutoTokenizer.from_pretrained(caller_dir)
    assert extra["prompt_token_ids"] == tok.encode(
        tok.apply_chat_template(CHAT, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    )
    assert extra["response_token_ids"] == tok.encode(ANSWER) + [tok.eos_token_id]
    spans = extra["meta_info"]["weight_versions"]
    assert spans == [{"version": "default", "start": 0, "end": len(extra["response_token_ids"])}]
    assert r.metadata == {"weight_version": "default", "weight_versions": spans}


def test_a_multi_turn_chat_with_a_tool_result(client, model):
    first = client.chat.completions.create(model=model, messages=CHAT, tools=TOOLS, temperature=0)
    msg = first.choices[0].message
    turn = [
        *CHAT,
        msg.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "5"},
    ]
    r = client.chat.completions.create(model=model, messages=turn, tools=TOOLS, max_tokens=2)
    assert r.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"top_logprobs": 50}, "top_logprobs"),
        ({"stream": True, "return_token_ids": True}, "return_token_ids"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_bad_requests_are_openai_400s_naming_the_field(engine, model, extra, param):
    body = {"model": model, "messages": CHAT, "tools": TOOLS, **extra}
    r = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["object"] == "error" and err["code"] == 400 and err["param"] == param
    assert param in err["message"].replace(" ", "_") or param == "messages"


def test_the_client_raises_on_400_and_404(client, model):
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        client.chat.completions.create(model=model, messages=CHAT, frequency_penalty=0.5)
    with pytest.raises(openai.BadRequestError, match="required"):
        client.chat.completions.create(model=model, messages=CHAT, tool_choice="required")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-nope", messages=CHAT)
    # the engine keeps serving
    assert client.chat.completions.create(model=model, messages=CHAT, max_tokens=1).choices


def test_a_stream_the_client_leaves_is_aborted(engine, model):
    import time

    body = {
        "model": model,
        "messages": CHAT,
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", engine.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 30
    while httpx.get(engine.url + "/engine_stats", timeout=10).json()["running"]:
        assert time.monotonic() < deadline, "the abandoned request still runs"
        time.sleep(0.1)
