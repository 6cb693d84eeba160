"""Routes from the generators (routing replay, issue #55): the parser reads SGLang 0.5.23's
``meta_info.routed_experts`` (base64 of int32 ``[prompt + completion - 1, num_hidden_layers,
top_k]``, docs/moe.md) into the sample's compact ``[positions, moe_layers, top_k]``; a resumed
request's and a conversation's turns keep the experts that sampled their tokens; and the pool asks
the real built-in engine for them."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from asyncrl import wire
from asyncrl.moe import RouteShape, fit_routes, route_problem, splice_routes
from asyncrl.rollout.sglang_protocol import (
    GeneratorResponseError,
    SamplingParams,
    generate_payload,
    parse_generate_response,
)
from asyncrl.rollout.turns import split_turns

SHAPE = RouteShape(layers=3, moe=(1, 2), top_k=2, experts=8)  # layer 0 dense (mlp_only_layers)


def sglang_body(prompt_tokens: int, output_ids: list[int], routes: torch.Tensor | None) -> dict:
    """A /generate response as SGLang 0.5.23 writes it: ``routed_experts`` is the detokenizer's
    ``b64encode(tensor.numpy().tobytes())`` of the int32 capture rows."""
    meta = {
        "id": "r",
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(output_ids),
        "finish_reason": {"type": "length", "length": len(output_ids)},
        "output_token_logprobs": [[-0.25, t, None] for t in output_ids],
        "weight_version": "3",
        "weight_versions": [{"version": "3", "start": 0, "end": len(output_ids)}],
    }
    if routes is not None:
        meta["routed_experts"] = base64.b64encode(routes.numpy().tobytes()).decode("utf-8")
    return {"text": "", "output_ids": output_ids, "meta_info": meta}


def capture_rows(rows: int, seed: int = 0) -> torch.Tensor:
    """SGLang's capture rows: int32, zero in the dense layer, each MoE layer k distinct ids."""
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(rows, SHAPE.layers, SHAPE.top_k, dtype=torch.int32)
    for li in SHAPE.moe:
        for r in range(rows):
            out[r, li] = torch.randperm(SHAPE.experts, generator=g)[: SHAPE.top_k].to(torch.int32)
    return out


def test_the_parser_reads_sglangs_routed_experts():
    prompt, out = 5, [7, 8, 9, 10]
    rows = capture_rows(prompt + len(out) - 1)
    seg = parse_generate_response(sglang_body(prompt, out, rows), routes=SHAPE)
    assert seg.routed_experts is not None and seg.routed_experts.dtype == np.uint8
    assert seg.routed_experts.shape == (prompt + len(out) - 1, 2, 2)  # the MoE layers' rows
    assert np.array_equal(seg.routed_experts, rows[:, 1:].numpy())
    assert seg.output_ids == out and seg.versions == [3] * 4
    # not asked: not parsed (a body without the key is fine)
    assert parse_generate_response(sglang_body(prompt, out, None)).routed_experts is None
    wrong_id = rows.clone()
    wrong_id[2, 1, 0] = 8
    not_base64 = sglang_body(prompt, out, rows)
    not_base64["meta_info"]["routed_experts"] = "not base64!"
    for body, match in (
        (sglang_body(prompt, out, None), r"routed_experts: missing .*--enable-return-routed-exp"),
        # one row per token, the last included: not SGLang's count
        (sglang_body(prompt, out, capture_rows(prompt + len(out))), r"54 int32, but 8 positions"),
        (sglang_body(prompt, out, wrong_id), r"expert id 8 outside \[0, 8\)"),
        (not_base64, "not valid base64"),
    ):
        with pytest.raises(GeneratorResponseError, match=match) as e:
            parse_generate_response(body, routes=SHAPE)
        assert "\n" not in str(e.value)


def test_requests_ask_for_routes_only_with_replay():
    params = SamplingParams(max_new_tokens=4)
    assert "return_routed_experts" not in generate_payload(
        [1, 2], params, max_new_tokens=4, rid="a"
    )
    asked = generate_payload([1, 2], params, max_new_tokens=4, rid="a", routed_experts=True)
    assert asked["return_routed_experts"] is True


def test_a_later_request_keeps_the_experts_that_sampled_earlier_tokens():
    """A resumed request or a conversation's next turn re-feeds the earlier tokens: their
    positions keep the routes they were sampled with; the rest (tool output) takes the new
    request's; tool output after the last generated token pads with experts 0..top_k-1, each
    once, as a router's top-k (the learner refuses an expert twice at one position)."""
    first = np.full((4 + 3 - 1, 2, 2), 1, np.uint8)  # prompt 4, produced 3
    # the next request: prompt 4 + 3 produced + 2 tool tokens = 9 input, produces 2
    second = np.full((9 + 2 - 1, 2, 2), 2, np.uint8)
    got = splice_routes(first, second, produced=2)
    assert got.shape == second.shape
    assert (got[:6] == 1).all() and (got[6:] == 2).all()  # positions 6, 7 (tool), 8.. new
    assert splice_routes(None, second, 2) is second
    assert fit_routes(None, 5) is None
    padded = fit_routes(first, 8)
    assert padded.shape == (8, 2, 2) and (padded[:6] == 1).all()
    assert (padded[6:] == [0, 1]).all() and route_problem(padded[6:], SHAPE) is None
    assert fit_routes(first, 6) is first


def test_per_turn_samples_keep_their_input_positions_routes():
    routes = np.arange(9 * 2 * 2, dtype=np.int32).reshape(9, 2, 2) % 8
    n = 7
    s = wire.Sample(
        id="e",
        group_id="g",
        prompt_ids=np.arange(3, dtype=np.int32),
        completion_ids=np.arange(n, dtype=np.int32),
        behavior_logprobs=np.zeros(n, np.float32),
        versions=np.zeros(n, np.int32),
        loss_mask=np.array([1, 1, 0, 0, 1, 1, 1], np.float32),
        routed_experts=routes.astype(np.uint8),
    )
    turns = split_turns(s)
    assert [len(t.routed_experts) for t in turns] == [3 + 2 - 1, 3 + 7 - 1]
    for t in turns:
        assert np.array_equal(t.routed_experts, routes[: len(t.routed_experts)])
        assert len(t.routed_experts) == len(t.prompt_ids) + len(t.completion_ids) - 1
    wire.decode(wire.encode(wire.Group(id="g", samples=turns)))  # valid on the wire


def test_the_pool_asks_the_engine_and_gets_every_positions_experts(tmp_path):
    """The real built-in engine serving an MoE with a dense first layer: the pool's completion
    carries [prompt + completion - 1, moe_layers, top_k], transformers' top-k at each."""
    import json

    import trio

    from asyncrl.engine.api import EngineConfig
    from asyncrl.engine.server import serve
    from asyncrl.rollout.generator_pool import GeneratorPool
    from tests.engine.test_moe_routes import hf_routes
    from tests.labels import set_label
    from tools.make_tiny_model import make_tiny_model

    folder = make_tiny_model(
        tmp_path / "moe",
        arch="qwen3_moe",
        hidden=64,
        layers=3,
        experts=8,
        top_k=2,
        moe_intermediate=32,
        dense_layers=(0,),
        seed=5,
    )
    shape = RouteShape.from_config(json.loads((folder / "config.json").read_text()))
    assert shape == SHAPE
    srv = serve(EngineConfig(model=str(folder), max_batch_size=4))
    try:
        set_label(srv.url, "0")
        prompt = [5, 6, 7, 8]

        async def go():
            async with GeneratorPool([srv.url], routes=shape) as pool:
                await pool.label()
                return await pool.generate(prompt, SamplingParams(max_new_tokens=5))

        c = trio.run(go)
    finally:
        srv.stop()
    ids = prompt + c.output_ids
    assert c.routed_experts is not None and c.routed_experts.dtype == np.uint8
    want = hf_routes(folder, ids)[:-1, 1:]
    assert np.array_equal(np.sort(c.routed_experts, -1), np.sort(want, -1))
