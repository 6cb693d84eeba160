"""``/generate`` on real SGLang 0.5.23: the response schema, and asyncrl's rollout client against a
plain transformers forward pass over the same tokens (the client's samples must be exact)."""

from __future__ import annotations

import httpx
import pytest
import torch
import trio
from sglang_helpers import PROMPT, TOL, Served, generate, reference_logprobs

from asyncrl.rollout.generator_pool import GeneratorPool
from asyncrl.rollout.sglang_protocol import SamplingParams

pytestmark = pytest.mark.sglang


def test_generate_response_schema(served: Served):
    """Plain HTTP: every field the client reads, in the shape SGLang 0.5.23 sends it."""
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
        "return_logprob": True,
    }
    r = httpx.post(served.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    triples = meta["output_token_logprobs"]
    n = len(triples)
    assert 1 <= n <= 8
    assert out["output_ids"] == [t[1] for t in triples]
    for lp, tok, text in triples:
        assert isinstance(lp, float) and lp <= 0.0
        assert isinstance(tok, int) and text is None
    assert meta["prompt_tokens"] == len(PROMPT)
    assert meta["completion_tokens"] == n
    assert meta["num_retractions"] == 0
    assert meta["weight_version"] == served.label
    assert meta["weight_versions"] == [{"version": served.label, "start": 0, "end": n}]
    fr = meta["finish_reason"]
    if fr["type"] == "length":
        assert fr == {"type": "length", "length": 8} and n == 8
    else:  # the random model chose EOS: matched is its id, the last output token
        assert fr["type"] == "stop" and fr["matched"] == out["output_ids"][-1]


def test_unknown_sampling_key_is_refused(served: Served):
    """Why the client sends only known sampling keys: SGLang 0.5.23 answers 400 to any other."""
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "logprobs": 1}}
    r = httpx.post(served.url + "/generate", json=body, timeout=60)
    assert r.status_code == 400 and "logprobs" in r.text


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_client_samples_match_transformers(served: Served, temperature: float):
    """Tokens, behaviour logprobs (log softmax(logits/T); greedy: unscaled) and versions parsed by
    the client equal a transformers forward over prompt + output."""
    params = SamplingParams(max_new_tokens=32, temperature=temperature)
    c = generate(served.url, params)
    n = len(c.output_ids)
    assert c.finish_reason in ("stop", "length") and c.num_resumes == 0
    assert 1 <= n <= 32 and (c.finish_reason == "stop" or n == 32)
    assert len(c.logprobs) == len(c.versions) == n
    assert c.versions == [served.version] * n
    ref = reference_logprobs(served.reference(), PROMPT, c.output_ids, temperature)
    err = (ref - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max().item()
    assert err <= TOL, f"max |logprob error| {err:.2e}"
    if temperature == 0.0:  # greedy: every token is the reference's argmax
        with torch.no_grad():
            logits = served.reference()(torch.tensor([PROMPT + c.output_ids])).logits[0]
        argmax = logits[len(PROMPT) - 1 : -1].argmax(-1).tolist()
        assert c.output_ids == argmax


def test_client_stop_token_and_stop_string(served: Served):
    """A stop token id and a stop string end the sample at that token; ``matched`` is parsed."""
    from transformers import AutoTokenizer

    greedy = generate(served.url, SamplingParams(max_new_tokens=12, temperature=0.0)).output_ids
    k = next((i for i in range(1, len(greedy)) if greedy[i] not in greedy[:i]), 0)
    stop_id = greedy[k]
    c = generate(
        served.url, SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=[stop_id])
    )
    assert c.finish_reason == "stop" and c.matched_stop == stop_id
    assert c.output_ids == greedy[: k + 1]

    char = AutoTokenizer.from_pretrained(served.model_dir).decode([stop_id])
    c = generate(served.url, SamplingParams(max_new_tokens=12, temperature=0.0, stop=[char]))
    assert c.finish_reason == "stop" and c.matched_stop == char
    assert c.output_ids == greedy[: k + 1]


def test_client_wait_ready(served: Served):
    """The pool's readiness check reads SGLang's ``/health``: it returns (no GeneratorError) once
    the server answers it with 200."""

    async def run():
        async with GeneratorPool([served.url]) as pool:
            await pool.wait_ready(30)
        return httpx.get(served.url + "/health", timeout=10).status_code

    assert trio.run(run) == 200


def test_client_batched_group_matches_single_requests(served: Served):
    """A group's same-tick requests go to SGLang as one batched call (lists of input_ids,
    sampling_params and rids); each sample equals the same request sent alone (greedy)."""
    from asyncrl.rollout.generator_pool import Batcher

    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    prompts = [PROMPT, PROMPT[:-1], PROMPT[1:]]

    async def run():
        async with GeneratorPool([served.url], timeout_s=300) as pool:
            await pool.label()
            alone = [await pool.generate(p, params) for p in prompts]
            g = pool.generators[served.url]
            before, batcher, got = g.requests, Batcher(), {}

            async def one(i):
                got[i] = await pool.generate(prompts[i], params, batcher=batcher)

            async with trio.open_nursery() as n:
                for i in range(len(prompts)):
                    n.start_soon(one, i)
            return alone, got, g.requests - before

    alone, got, calls = trio.run(run)
    assert calls == 1
    for i, ref in enumerate(alone):
        assert got[i].output_ids == ref.output_ids
        assert got[i].versions == ref.versions
        assert got[i].logprobs == pytest.approx(ref.logprobs, abs=TOL)


def test_a_default_server_is_labelled_at_join(served: Served):
    """A server launched without --weight-version says "default"; the worker's label at join makes
    it "0" (/update_weight_version with abort_all_requests false: SGLang's default, true, would
    abort every running request), and a request running meanwhile is not aborted."""
    from asyncrl.rollout.sglang_protocol import UnlabelledTokens, parse_generate_response

    def set_label(label: str) -> dict:
        body = {"new_version": label, "abort_all_requests": False}
        r = httpx.post(served.url + "/update_weight_version", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    sampling = {"max_new_tokens": 200, "temperature": 0.0, "ignore_eos": True}

    async def run() -> tuple[dict, int | None]:
        out: list[dict] = []
        async with (
            httpx.AsyncClient(base_url=served.url, timeout=300) as http,
            GeneratorPool([served.url], timeout_s=300) as pool,
        ):

            async def gen() -> None:
                body = {"input_ids": PROMPT, "sampling_params": sampling, "return_logprob": True}
                out.append((await http.post("/generate", json=body)).json())

            async with trio.open_nursery() as nursery:
                nursery.start_soon(gen)
                assert await served.wait_generating(len(PROMPT) + 16, lambda: bool(out))
                await pool.label()
            return out[0], pool.generators[served.url].version

    assert set_label("default")["new_version"] == "default"  # as launched
    try:
        running, held = trio.run(run)
        info = httpx.get(served.url + "/model_info", timeout=60).json()
    finally:
        set_label(served.label)
    assert held == 0 and info["weight_version"] == "0"
    meta = running["meta_info"]
    assert meta["finish_reason"]["type"] == "length", meta["finish_reason"]  # not aborted
    # SGLang stamps the label on running requests as a version change: their tokens before it say
    # "default", which the client refuses (so a worker labels its servers before it generates)
    spans = meta["weight_versions"]
    assert [x["version"] for x in spans] == ["default", "0"], spans
    assert spans[0]["start"] == 0 < spans[0]["end"] == spans[1]["start"] < spans[1]["end"] == 200
    with pytest.raises(UnlabelledTokens, match="'default'"):
        parse_generate_response(running)
