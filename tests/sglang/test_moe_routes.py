"""Routed experts from the real SGLang 0.5.23 on CPU (issue #55): the tiny Qwen3-MoE (2 layers, 8
experts, top-2, untied embeddings) served with ``--enable-return-routed-experts`` (and, on a CPU-only
machine, tools/sglang_cpu/routes_shim: SGLang pins the routes buffer with CUDA; docs/moe.md). asyncrl's
rollout client asks for the routes and parses SGLang's live response into the MoE layers' rows of
every fed position, ``[prompt + completion - 1, moe_layers, top_k]``; those are the experts
transformers' router chooses for the same tokens.

Untied and without a dense layer, as Qwen3-30B-A3B: SGLang 0.5.23's Qwen3-MoE always has an lm_head
of its own, whatever ``tie_word_embeddings`` says, and makes every layer an MoE one, whatever
``mlp_only_layers`` says; it skips the weights it has no place for without a word and serves
another model (docs/moe.md: uniform logits for a tied checkpoint)."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest
import torch
import trio
from conftest import START_TIMEOUT_S
from sglang_helpers import TOL, healthy, reference_logprobs

from asyncrl.moe import RouteShape
from asyncrl.rollout.generator_pool import GeneratorPool
from asyncrl.rollout.sglang_protocol import SamplingParams, parse_routed_experts
from tools.sglang_cpu.server import ROUTES_ARGS, SGLangServer, routes_env

pytestmark = pytest.mark.sglang

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26]]

# A position's experts may differ from transformers' only where its router has a near-tie: SGLang's
# hidden states differ from transformers' by float32 rounding (its logprobs by ~3e-7,
# sglang_helpers.TOL), so a chosen expert's router logit may fall this far below transformers' k-th.
TIE = 1e-4


@pytest.fixture(scope="module")
def moe_untied(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("sglang_moe"), arch="qwen3_moe", tie_embeddings=False
    )


@pytest.fixture(scope="module")
def moe_server(sglang_python, moe_untied, tmp_path_factory):
    server = SGLangServer(
        python=sglang_python,
        model=moe_untied,
        log=tmp_path_factory.getbasetemp() / "sglang_moe.log",
        extra_args=["--disable-radix-cache", *ROUTES_ARGS],
        env=routes_env(),
    )
    yield from healthy(server, START_TIMEOUT_S)


def router_logits(model: torch.nn.Module, ids: list[int]) -> dict[int, torch.Tensor]:
    """transformers' router logits of every position of ``ids`` at each MoE layer, ``[len(ids),
    experts]``, read with a hook on each MoE layer's gate."""
    out: dict[int, torch.Tensor] = {}
    hooks = []
    for li, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "experts"):
            hooks.append(
                layer.mlp.gate.register_forward_hook(
                    lambda _m, _i, o, li=li: out.__setitem__(li, o[0].reshape(len(ids), -1))
                )
            )
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return out


def assert_transformers_routes(
    model: torch.nn.Module, ids: list[int], got: np.ndarray, shape: RouteShape
) -> int:
    """``got`` (``[len(ids) - 1, moe_layers, top_k]``) holds, at every position, top_k distinct
    experts whose router logits are transformers' top-k up to a near-tie (:data:`TIE`). Returns the
    number of (position, layer) whose set differs from transformers' top-k set."""
    logits = router_logits(model, ids)
    differ = 0
    for j, li in enumerate(shape.moe):
        lg = logits[li][:-1]  # the last token is never fed
        want = torch.topk(lg, shape.top_k, dim=-1)
        chosen = torch.from_numpy(got[:, j].astype(np.int64))
        assert all(len(set(row.tolist())) == shape.top_k for row in chosen)
        kth = want.values[:, -1:]
        assert (lg.gather(1, chosen) >= kth - TIE).all(), (li, chosen, want.indices)
        same = (chosen.sort(-1).values == want.indices.sort(-1).values).all(-1)
        differ += int((~same).sum())
    return differ


def test_sglang_returns_the_routes_transformers_chooses(moe_server, moe_untied):
    shape = RouteShape.from_config(json.loads((moe_untied / "config.json").read_text()))
    assert shape is not None and shape.moe == (0, 1) and shape.top_k == 2
    params = SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True)

    async def rollout():  # the three prompts at once, as a worker's episodes go
        done = [None] * len(PROMPTS)
        async with GeneratorPool([moe_server.url], timeout_s=300, routes=shape) as pool:
            await pool.label()
            async with trio.open_nursery() as nursery:
                for i, prompt in enumerate(PROMPTS):

                    async def one(i=i, prompt=prompt):
                        done[i] = await pool.generate(prompt, params)

                    nursery.start_soon(one)
        return done

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(moe_untied, dtype=torch.float32).eval()
    differ = positions = 0
    for prompt, c in zip(PROMPTS, trio.run(rollout), strict=True):
        ids = prompt + c.output_ids
        assert len(c.output_ids) == 6 and c.routed_experts is not None
        assert c.routed_experts.dtype == np.uint8
        assert c.routed_experts.shape == (len(ids) - 1, 2, 2)  # the MoE layers' rows
        assert int(c.routed_experts.max()) < shape.experts
        differ += assert_transformers_routes(hf, ids, c.routed_experts, shape)
        # and SGLang serves this MoE as transformers computes it (its experts, not only its routes)
        want = reference_logprobs(hf, prompt, c.output_ids, temperature=1.0)
        assert torch.allclose(torch.tensor(c.logprobs, dtype=torch.float64), want, atol=TOL)
        positions += c.routed_experts.shape[0] * 2
    print(f"routes: {differ} of {positions} (position, MoE layer) sets differ from transformers'")

    # the raw body: int32 [positions, layers, top_k], which the parser reads as the sample keeps it
    body = {
        "input_ids": PROMPTS[1],
        "sampling_params": params.to_json(),
        "return_routed_experts": True,
    }
    res = httpx.post(moe_server.url + "/generate", json=body, timeout=300).json()
    rows = len(PROMPTS[1]) + len(res["output_ids"]) - 1
    raw = np.frombuffer(base64.b64decode(res["meta_info"]["routed_experts"]), dtype="<i4")
    raw = raw.reshape(rows, 2, 2)
    parsed = parse_routed_experts(res["meta_info"], rows, shape)
    assert np.array_equal(parsed, raw)
    # not asked: none sent
    del body["return_routed_experts"]
    plain = httpx.post(moe_server.url + "/generate", json=body, timeout=300).json()
    assert "routed_experts" not in plain["meta_info"]
