"""Workflows against the real built-in engine: real tokens, logprobs checked against HF transformers."""

from __future__ import annotations

import pytest
import torch
import trio

from asyncrl.agents.tools import ToolCall, ToolRegistry, parse_tagged_tool_call, tool_from_function
from asyncrl.rollout.generator_pool import GeneratorPool
from asyncrl.rollout.sglang_protocol import SamplingParams
from asyncrl.rollout.workflows import EpisodeContext, SingleTurn, load_workflow
from tests.numerics import assert_logits_close


@pytest.fixture
def engine(rollout_engine):
    return rollout_engine


@pytest.fixture(scope="module")
def hf(tiny_qwen3):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(tiny_qwen3)


def teacher_forced_logprobs(model, prompt_ids, completion_ids, temperature=1.0):
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1] / temperature
    lp = torch.log_softmax(logits.float(), -1)
    return lp[torch.arange(len(completion_ids)), torch.tensor(completion_ids)].tolist()


def run_episode(engine, tok, workflow, prompt, params, *, tools=None, max_turns=1):
    async def go():
        async with GeneratorPool([engine.url]) as pool:
            await pool.label()  # "default" (as launched) is version 0; later tests may leave "0"
            ids = tok.encode(prompt)
            ctx = EpisodeContext(
                prompt_ids=ids,
                prompt_text=prompt,
                row={"prompt": prompt},
                pool=pool,
                params=params,
                tokenizer=tok,
                tools=tools or ToolRegistry([]),
                max_turns=max_turns,
                rid="test",
            )
            return ids, await workflow.run_episode(ctx)

    return trio.run(go)


def test_single_turn_logprobs_are_the_models(engine, hf):
    model, tok = hf
    params = SamplingParams(max_new_tokens=24, temperature=1.0)
    prompt_ids, ep = run_episode(engine, tok, SingleTurn(), "12+34=", params)
    ep.check()
    n = len(ep.completion_ids)
    assert 0 < n <= 24 and ep.loss_mask == [1] * n and ep.versions == [0] * n
    ref = teacher_forced_logprobs(model, prompt_ids, ep.completion_ids)
    assert_logits_close(ep.logprobs, ref)


def test_single_turn_greedy_equals_direct_engine_request(engine, hf):
    import httpx

    _, tok = hf
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    prompt_ids, ep = run_episode(engine, tok, SingleTurn(), "abc=", params)
    body = httpx.post(
        engine.url + "/generate",
        json={"input_ids": prompt_ids, "sampling_params": params.to_json(), "return_logprob": True},
        timeout=60,
    ).json()
    assert ep.completion_ids == body["output_ids"]
    assert ep.logprobs == [t[0] for t in body["meta_info"]["output_token_logprobs"]]


def test_multi_turn_masks_exactly_the_tool_tokens(engine, hf):
    from tests import rollout_plugins

    model, tok = hf
    wf = load_workflow("tests.rollout_plugins:tool_workflow")
    params = SamplingParams(max_new_tokens=200, temperature=1.0)
    prompt_ids, ep = run_episode(engine, tok, wf, "q: ", params, max_turns=3)
    ep.check()
    calls = ep.metadata["tool_calls"]
    assert [c["turn"] for c in calls] == [0, 1] and all(c["ok"] for c in calls)
    # rebuild the completion from its runs of mask 1 (model) and mask 0 (tool) tokens
    runs, cur = [], None
    for t, m in zip(ep.completion_ids, ep.loss_mask, strict=True):
        if cur is None or cur[0] != m:
            cur = (m, [])
            runs.append(cur)
        cur[1].append(t)
    assert [m for m, _ in runs] == [1, 0, 1, 0, 1]
    for (_, gen), (_, result) in zip(runs[0::2], runs[1::2], strict=False):
        text = tok.decode(gen, skip_special_tokens=True)
        expected = f"\n<result>{rollout_plugins.char_code_sum(text[:4])}</result>\n"
        assert tok.decode(result) == expected
    # every tool token has logprob 0; every model token the model's own logprob given all before it
    lp_ref = teacher_forced_logprobs(model, prompt_ids, ep.completion_ids)
    model_tokens = [m == 1 for m in ep.loss_mask]
    assert all(lp == 0.0 for lp, m in zip(ep.logprobs, model_tokens, strict=True) if not m)
    assert_logits_close(
        [lp for lp, m in zip(ep.logprobs, model_tokens, strict=True) if m],
        [r for r, m in zip(lp_ref, model_tokens, strict=True) if m],
    )


def test_tool_schema_from_signature():
    def search(query: str, k: int = 3, exact: bool | None = None) -> list[str]:
        """Search the notes.

        Longer text the model does not need."""
        return [query] * k

    t = tool_from_function(search)
    assert t.schema()["function"] == {
        "name": "search",
        "description": "Search the notes.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "k": {"type": "integer"},
                "exact": {"type": "boolean"},
            },
            "required": ["query"],
        },
    }


def test_tool_calls_parse_run_and_fail_softly():
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    def boom() -> str:
        """Always fails."""
        raise RuntimeError("nope")

    reg = ToolRegistry([tool_from_function(add), tool_from_function(boom)])
    call = parse_tagged_tool_call('x <tool>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool>')
    assert call == ToolCall(name="add", arguments={"a": 2, "b": 3})
    assert parse_tagged_tool_call("no call here") is None

    async def go():
        return [
            await reg.call(call),
            await reg.call(ToolCall(name="add", arguments={"a": 1})),
            await reg.call(ToolCall(name="nope", arguments={})),
            await reg.call(ToolCall(name="boom", arguments={})),
            await reg.call(parse_tagged_tool_call("<tool>{not json</tool>")),
        ]

    res = trio.run(go)
    assert res[0] == ("5", True)
    assert res[1][1] is False and "needs argument(s) b" in res[1][0]
    assert "no tool named 'nope'" in res[2][0]
    assert "RuntimeError: nope" in res[3][0]
    assert "not valid JSON" in res[4][0]
    assert reg.stats["errors"] == 4
