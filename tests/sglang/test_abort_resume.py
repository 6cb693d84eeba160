"""``pause_generation {"mode": "abort"}`` on real SGLang: the in-flight request comes back as an
abort with partial output, the rollout client re-sends prompt + partial output (held by SGLang until
``continue_generation``), and the pieces join into one complete, exact sample."""

from __future__ import annotations

import httpx
import pytest
import torch
import trio
from sglang_helpers import PROMPT, TOL, Served, reference_logprobs

from asyncrl.rollout.client import Completion, GeneratorPool, SamplingParams

pytestmark = pytest.mark.sglang

BUDGET = 300


async def _abort_mid_request(served: Served) -> Completion:
    done: list[Completion] = []

    async def gen(pool: GeneratorPool) -> None:
        done.append(await pool.generate(PROMPT, SamplingParams(max_new_tokens=BUDGET)))

    async with (
        GeneratorPool([served.url], timeout_s=300) as pool,
        httpx.AsyncClient(base_url=served.url, timeout=120) as http,
    ):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gen, pool)
            if await served.wait_generating(len(PROMPT) + 16, lambda: bool(done)):
                r = await http.post("/pause_generation", json={"mode": "abort"})
                assert r.status_code == 200, r.text
                r = await http.post("/continue_generation", json={})
                assert r.status_code == 200, r.text
    return done[0]


def test_abort_pause_resubmits_to_a_complete_sample(served: Served):
    for _ in range(5):  # a random tiny model may emit EOS before the pause: try again
        c = trio.run(_abort_mid_request, served)
        if c.num_resumes >= 1:
            break
    else:
        pytest.fail("the request ended before the abort pause in 5 tries")
    n = len(c.output_ids)
    assert c.finish_reason in ("stop", "length")
    assert n >= 8 and (c.finish_reason == "stop" or n == BUDGET)
    assert len(c.logprobs) == len(c.versions) == n
    assert c.versions == [served.version] * n
    ref = reference_logprobs(served.reference(), PROMPT, c.output_ids)
    err = (ref - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max().item()
    assert err <= TOL, f"max |logprob error| {err:.2e} across the resubmission"
