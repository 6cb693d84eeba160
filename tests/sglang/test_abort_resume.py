"""``pause_generation {"mode": "abort"}`` on real SGLang: the in-flight request comes back as an
abort with partial output, the rollout client re-sends prompt + partial output (held by SGLang until
``continue_generation``), and the pieces join into one complete, exact sample."""

from __future__ import annotations

import httpx
import pytest
import torch
import trio
from sglang_helpers import PROMPT, TOL, Served, reference_logprobs

from asyncrl.rollout.generator_pool import Completion, GeneratorPool
from asyncrl.rollout.sglang_protocol import SamplingParams, parse_generate_response

pytestmark = pytest.mark.sglang

BUDGET = 300


async def _abort_mid_request(served: Served) -> Completion:
    done: list[Completion] = []

    async def gen(pool: GeneratorPool) -> None:
        # ignore_eos: a random tiny model may pick EOS early, and the request must outlive the pause
        params = SamplingParams(max_new_tokens=BUDGET, ignore_eos=True)
        done.append(await pool.generate(PROMPT, params))

    async with (
        GeneratorPool([served.url], timeout_s=300) as pool,
        httpx.AsyncClient(base_url=served.url, timeout=120) as http,
    ):
        await pool.label()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gen, pool)
            assert await served.wait_generating(len(PROMPT) + 16, lambda: bool(done))
            r = await http.post("/pause_generation", json={"mode": "abort"})
            assert r.status_code == 200, r.text
            r = await http.post("/continue_generation", json={})
            assert r.status_code == 200, r.text
    return done[0]


def test_abort_pause_resubmits_to_a_complete_sample(served: Served):
    c = trio.run(_abort_mid_request, served)
    n = len(c.output_ids)
    assert c.num_resumes >= 1
    assert c.finish_reason == "length" and n == BUDGET
    assert len(c.logprobs) == len(c.versions) == n
    assert c.versions == [served.version] * n
    ref = reference_logprobs(served.reference(), PROMPT, c.output_ids)
    err = (ref - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max().item()
    assert err <= TOL, f"max |logprob error| {err:.2e} across the resubmission"


def test_abort_response_is_a_partial_segment(served: Served):
    """Plain HTTP: what the abort pause returns to an in-flight request (HTTP 200, finish_reason
    abort with a message, the partial tokens, logprobs and spans), through the client's parser."""
    sampling = {"max_new_tokens": 400, "ignore_eos": True}  # cannot end before the pause

    async def run() -> httpx.Response:
        out: list[httpx.Response] = []
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as http:

            async def gen() -> None:
                body = {"input_ids": PROMPT, "sampling_params": sampling, "return_logprob": True}
                out.append(await http.post("/generate", json=body))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(gen)
                assert await served.wait_generating(len(PROMPT) + 16, lambda: bool(out))
                assert (await http.post("/pause_generation", json={"mode": "abort"})).is_success
                assert (await http.post("/continue_generation", json={})).is_success
        return out[0]

    r = trio.run(run)
    assert r.status_code == 200, r.text
    body = r.json()
    fr = body["meta_info"]["finish_reason"]
    assert fr["type"] == "abort" and isinstance(fr["message"], str) and fr["message"]
    seg = parse_generate_response(body)
    n = len(seg.output_ids)
    assert seg.finish_reason == "abort" and seg.abort_message == fr["message"]
    assert 8 <= n < 400 and len(seg.logprobs) == n
    assert body["meta_info"]["weight_versions"] == [{"version": served.label, "start": 0, "end": n}]
    assert seg.versions == [served.version] * n
    assert seg.prompt_tokens == len(PROMPT)
