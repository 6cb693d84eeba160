"""The generator client: response parsing on real recorded SGLang 0.5.23 responses, and the pool
(labels, the version bound, resubmission) against the real built-in engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.generator_http import GeneratorError
from asyncrl.rollout.sglang_protocol import (
    GeneratorResponseError,
    SamplingParams,
    UnlabelledTokens,
    generate_payload,
    parse_generate_response,
    spans_to_versions,
    version_at_join,
    with_adapter,
)
from tests.labels import get_label, set_label
from tests.numerics import assert_logits_close
from tests.ports import refused_url

RECORDED = Path(__file__).parents[1] / "data" / "sglang-recorded"


def _recorded(name: str) -> dict:
    path = RECORDED / name
    if not path.exists():
        pytest.skip(f"{path} not available")
    return json.loads(path.read_text())


def _labelled(body: dict, label: str) -> dict:
    """``body`` as a server labelled ``label`` would have sent it (only the version fields change)."""
    body = json.loads(json.dumps(body))
    meta = body["meta_info"]
    meta["weight_version"] = label
    meta["weight_versions"] = [{**s, "version": label} for s in meta["weight_versions"]]
    return body


def test_parse_recorded_sglang_response():
    body = _recorded("generate_logprob.json")
    # the recorded server was never labelled: its tokens' version "default" is refused, not guessed
    with pytest.raises(UnlabelledTokens, match=r"weight_versions\[0\].*'default'"):
        parse_generate_response(body)
    seg = parse_generate_response(_labelled(body, "0"))  # as after the worker's label at join
    assert seg.output_ids == body["output_ids"]
    assert seg.logprobs == [t[0] for t in body["meta_info"]["output_token_logprobs"]]
    assert seg.versions == [0] * len(seg.output_ids) and seg.weight_version == 0
    assert seg.finish_reason == "length"
    assert seg.prompt_tokens == 5


def test_parse_last_recorded_stream_chunk_has_spans():
    chunks = [
        json.loads(line[len("data: ") :])
        for line in (RECORDED / "generate_stream.txt").read_text().splitlines()
        if line.startswith("data: {")
    ]
    last = _labelled(chunks[-1], "4")
    seg = parse_generate_response(last)
    assert len(seg.output_ids) == len(seg.logprobs) == len(seg.versions) > 0
    assert seg.versions == [4] * len(seg.output_ids)
    assert seg.finish_reason in ("stop", "length")


def test_a_request_that_named_a_lora_adapter_takes_the_adapters_version():
    """SGLang serves a request with the adapter it named to its end; its spans follow the label,
    which moves to the next version once that adapter is loaded (tests/sglang/test_lora.py)."""
    body = _labelled(_recorded("generate_logprob.json"), "3")
    n = len(body["output_ids"])
    body["meta_info"]["weight_versions"] = [
        {"version": "3", "start": 0, "end": 2},
        {"version": "4", "start": 2, "end": n},
    ]
    assert parse_generate_response(body).versions == [3, 3] + [4] * (n - 2)
    assert parse_generate_response(body, adapter=3).versions == [3] * n
    payload = generate_payload([1, 2], SamplingParams(), max_new_tokens=4, rid="r")
    assert with_adapter(payload, 3) == {**payload, "lora_path": "v3"}
    assert with_adapter(payload, 0) == with_adapter(payload, None) == payload  # the base model


def test_spans_give_per_token_versions():
    spans = [{"version": "v2", "start": 0, "end": 3}, {"version": "5", "start": 3, "end": 6}]
    assert spans_to_versions(spans, 6) == [2, 2, 2, 5, 5, 5]
    assert spans_to_versions(None, 0) == spans_to_versions([], 0) == []  # no tokens, no versions
    with pytest.raises(GeneratorResponseError, match=r"weight_versions\[0\]"):
        spans_to_versions([{"version": "1", "start": 0, "end": 9}], 6)


@pytest.mark.parametrize(
    "spans, match",
    [
        (None, "missing"),  # SGLang older than 0.5.19: no spans at all
        ([{"version": "3", "start": 0, "end": 4}], "token 4 of 6 has no span"),
        ([{"version": "3", "start": 2, "end": 6}], "token 0 of 6 has no span"),
        (
            [{"version": "default", "start": 0, "end": 2}, {"version": "3", "start": 2, "end": 6}],
            r"weight_versions\[0\]: version 'default' of tokens \[0, 2\)",
        ),
        ([{"version": "latest", "start": 0, "end": 6}], "'latest'"),
    ],
)
def test_tokens_without_a_numeric_version_are_refused(spans, match):
    with pytest.raises(UnlabelledTokens, match=match):
        spans_to_versions(spans, 6)


def test_the_version_a_generator_holds_when_a_worker_joins_it():
    assert version_at_join("7") == (7, False)  # labelled: e.g. it outlived a worker restart
    assert version_at_join("v0") == (0, False)
    assert version_at_join("default") == (0, True)  # launched from model.path: label it "0"
    with pytest.raises(GeneratorError, match="'latest' is not a policy version.*--weight-version"):
        version_at_join("latest")


def test_abort_response_keeps_partial_output():
    body = {
        "output_ids": [5, 6],
        "meta_info": {
            "finish_reason": {"type": "abort", "message": "Aborted", "status_code": None},
            "output_token_logprobs": [[-1.0, 5, None], [-2.0, 6, None]],
            "weight_versions": [{"version": "1", "start": 0, "end": 2}],
        },
    }
    seg = parse_generate_response(body)
    assert (seg.finish_reason, seg.abort_message) == ("abort", "Aborted")
    assert seg.output_ids == [5, 6] and seg.logprobs == [-1.0, -2.0] and seg.versions == [1, 1]


@pytest.mark.parametrize(
    "meta, match",
    [
        ({"finish_reason": {"type": "length"}}, "output_token_logprobs"),
        ({"finish_reason": {"type": "??"}, "output_token_logprobs": []}, "finish_reason"),
        (
            {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[None, 3, None]]},
            "logprob",
        ),
    ],
)
def test_malformed_responses_name_the_field(meta, match):
    with pytest.raises(GeneratorResponseError, match=match):
        parse_generate_response({"meta_info": meta})


def test_output_ids_must_agree_with_logprobs():
    body = {
        "output_ids": [1, 2],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 1},
            "output_token_logprobs": [[-0.5, 1, None]],
        },
    }
    with pytest.raises(GeneratorResponseError, match="disagree"):
        parse_generate_response(body)


def test_sampling_params_send_only_sglang_keys():
    d = SamplingParams(max_new_tokens=7, stop=["</tool>"]).to_json(max_new_tokens=3)
    assert d["max_new_tokens"] == 3 and d["stop"] == ["</tool>"] and "ignore_eos" not in d
    allowed = set(_recorded_allowed_keys())
    assert set(d) <= allowed
    every = SamplingParams(stop=["x"], stop_token_ids=[2], ignore_eos=True).to_json()
    assert every["ignore_eos"] is True and set(every) <= allowed


def _recorded_allowed_keys() -> list[str]:
    text = (RECORDED / "generate_bad_sampling_key.txt").read_text()
    inner = text.split("expected one of", 1)[1].split('"}')[0]
    return [k.strip(" `") for k in inner.split(",")]


# --------------------------------------------------------------------------------------------------
# Against the real built-in engine
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def engine(rollout_engine):
    """The shared engine, labelled "0" (its weights are its model's) before and after each test."""
    set_label(rollout_engine.url, "0")
    yield rollout_engine
    set_label(rollout_engine.url, "0")


def test_abort_and_resume_equals_one_uninterrupted_stream(engine):
    """The engine is paused in `abort` mode mid-generation; the client resubmits prompt + partial
    output and the finished sample equals one uninterrupted greedy stream."""
    import httpx
    import trio

    from asyncrl.rollout.generator_pool import GeneratorPool

    prompt = [10, 11, 12, 13, 14]
    params = SamplingParams(max_new_tokens=400, temperature=0.0)
    sched = engine.engine.scheduler

    async def interrupted(pool, http):
        out = {}

        async def gen():
            out["c"] = await pool.generate(prompt, params, rid="resume-test")

        async with trio.open_nursery() as n:
            n.start_soon(gen)
            with trio.fail_after(60):  # wait until it is really mid-generation
                while not any(len(r.output_ids) >= 8 for r in list(sched.running)):
                    if "c" in out:
                        return None  # finished before we could pause: the caller retries
                    await trio.sleep(0.001)
            r = await http.post(engine.url + "/pause_generation", json={"mode": "abort"})
            assert r.status_code == 200
            # the aborted request comes back and is resubmitted; a paused engine holds it
            with trio.fail_after(60):
                while not sched.waiting and "c" not in out:
                    await trio.sleep(0.005)
            r = await http.post(engine.url + "/continue_generation", json={})
            assert r.status_code == 200
        return out["c"]

    async def go():
        async with GeneratorPool([engine.url]) as pool, httpx.AsyncClient() as http:
            await pool.label()
            ref = await pool.generate(prompt, params)
            for _ in range(5):
                got = await interrupted(pool, http)
                if got is not None and got.num_resumes:
                    return ref, got
            pytest.fail("could not pause the engine mid-generation in 5 tries")

    ref, got = trio.run(go)
    assert got.num_resumes >= 1
    assert got.finish_reason == ref.finish_reason
    assert got.output_ids == ref.output_ids
    assert_logits_close(got.logprobs, ref.logprobs)
    assert got.versions == ref.versions == [0] * len(ref.output_ids)


def test_unreachable_generator_is_marked_down_and_requests_move(engine):
    import trio

    from asyncrl.rollout.generator_pool import GeneratorPool

    async def go(dead: str):
        async with GeneratorPool([dead, engine.url], retry_s=30.0) as pool:
            for g in pool.generators.values():  # the dead one cannot be asked for its label
                g.version = 0
            results = []

            async def one(i):
                results.append(await pool.generate([5, 6, 7, i], SamplingParams(max_new_tokens=4)))

            async with trio.open_nursery() as n:
                for i in range(6):
                    n.start_soon(one, 20 + i)
            return pool, results

    with refused_url() as dead:  # held, not listening, for the whole run
        pool, results = trio.run(go, dead)
    assert len(results) == 6 and all(r.generator == engine.url for r in results)
    dead_state = pool.generators[dead]
    assert dead_state.failures >= 1 and dead_state.down_until > 0
    assert "ConnectError" in dead_state.last_error


def test_wait_ready_returns_for_a_serving_engine_and_names_one_that_never_answers(engine):
    import httpx
    import trio

    from asyncrl.rollout.generator_pool import GeneratorPool

    async def go(dead: str):
        async with GeneratorPool([engine.url]) as pool:
            await pool.wait_ready(30)
        healthy = httpx.get(engine.url + "/health", timeout=10).status_code
        async with GeneratorPool([engine.url, dead]) as pool:
            t0 = trio.current_time()
            with pytest.raises(GeneratorError, match="not ready after 1s") as e:
                await pool.wait_ready(1)
            return healthy, str(e.value), trio.current_time() - t0

    with refused_url() as dead:  # held, not listening, for the whole run
        healthy, err, waited = trio.run(go, dead)
    assert healthy == 200  # what wait_ready waited for
    assert dead in err and waited >= 1  # the whole timeout, then the generator that never answered


def test_requests_spread_by_load():
    import trio

    from asyncrl.rollout.generator_pool import GeneratorPool

    async def go():
        async with GeneratorPool(["http://a", "http://b", "http://c"]) as pool:
            for g in pool.generators.values():  # as after label(): all within the bound
                g.version = 0
            picks = []
            for _ in range(6):
                g = pool._pick(None)
                g.enter(trio.current_time())
                picks.append(g.url)
            return picks

    picks = trio.run(go)
    assert sorted(picks) == sorted(["http://a", "http://b", "http://c"] * 2)


def test_a_groups_same_tick_requests_go_as_one_batched_call(engine):
    """Episodes of one group share a Batcher: their concurrent requests are one HTTP call to the
    engine (SGLang's list form), and each gets exactly what it gets when sent alone."""
    import trio

    from asyncrl.rollout.generator_pool import Batcher, GeneratorPool

    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    too_long = [7] * 100_000  # refused by the engine (HTTP 400): it must fail alone

    async def go():
        async with GeneratorPool([engine.url]) as pool:
            await pool.label()
            alone = [await pool.generate(p, params) for p in prompts]
            g = pool.generators[engine.url]
            before = g.requests
            batcher, got, errors = Batcher(), {}, {}

            async def one(i, p):
                try:
                    got[i] = await pool.generate(p, params, rid=f"b{i}", batcher=batcher)
                except GeneratorError as e:
                    errors[i] = str(e)

            async with trio.open_nursery() as n:
                for i, p in enumerate(prompts):
                    n.start_soon(one, i, p)
            one_call = g.requests - before

            before = g.requests
            async with trio.open_nursery() as n:
                for i, p in enumerate([*prompts[:2], too_long]):
                    n.start_soon(one, 10 + i, p)
            return alone, got, errors, one_call, g.requests - before

    alone, got, errors, one_call, with_bad = trio.run(go)
    assert one_call == 1
    for i, ref in enumerate(alone):
        assert got[i].output_ids == ref.output_ids
        assert_logits_close(got[i].logprobs, ref.logprobs)
    assert set(errors) == {12} and "HTTP 400" in errors[12]
    assert got[10].output_ids == alone[0].output_ids and got[11].output_ids == alone[1].output_ids
    assert with_bad == 1 + 3  # the refused batch, then each request on its own


# --------------------------------------------------------------------------------------------------
# Versions: the label at join, the bound, refused tokens (the real built-in engine)
# --------------------------------------------------------------------------------------------------


def _running(engine, rid_prefix: str) -> list:
    sched = engine.engine.scheduler
    return [r for r in list(sched.running) + list(sched.waiting) if r.rid.startswith(rid_prefix)]


def test_label_at_join_names_the_base_weights_without_aborting(engine):
    """A generator launched without --weight-version says "default": label() names its weights
    version 0 (model.path's) before it generates, and a request it is running goes on."""
    import httpx
    import trio

    from asyncrl.rollout.generator_pool import GeneratorPool

    set_label(engine.url, "default")  # as launched: the fixture labelled it "0"
    body = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": 300, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
        "rid": "running-at-label",
    }

    async def go():
        async with GeneratorPool([engine.url]) as pool, httpx.AsyncClient(timeout=120) as http:
            out = {}

            async def long_request():
                out["r"] = (await http.post(engine.url + "/generate", json=body)).json()

            async with trio.open_nursery() as n:
                n.start_soon(long_request)
                with trio.fail_after(60):
                    while not _running(engine, "running-at-label") and "r" not in out:
                        await trio.sleep(0.001)
                await pool.label()
            c = await pool.generate([8, 9], SamplingParams(max_new_tokens=6))
            return out["r"], pool.generators[engine.url].version, c

    r, held, c = trio.run(go)
    assert get_label(engine.url) == "0" and held == 0
    assert r["meta_info"]["finish_reason"]["type"] == "length"  # not aborted by the label
    assert c.versions == [0] * len(c.output_ids)


def test_a_label_that_names_no_version_is_refused_at_join(engine):
    import trio

    from asyncrl.rollout.generator_pool import GeneratorPool

    set_label(engine.url, "latest")

    async def go():
        async with GeneratorPool([engine.url]) as pool:
            await pool.label()

    with pytest.raises(GeneratorError, match=f"{engine.url}: weight_version 'latest'"):
        trio.run(go)


def test_requests_wait_for_a_generator_within_the_version_bound(engine, caplog):
    """The learner is at 5 and eta is 2: a generator holding version 0 serves nothing; requests
    wait (polling /model_info) until the broadcaster's label says it holds 3 or newer."""
    import trio

    from asyncrl.rollout.generator_pool import GeneratorPool

    params = SamplingParams(max_new_tokens=6, temperature=0.0)

    async def go():
        async with GeneratorPool([engine.url], version_poll_s=0.05) as pool:
            await pool.label()
            g = pool.generators[engine.url]
            pool.min_version = 3
            out, reads = {}, set()

            async def one():
                out["c"] = await pool.generate([5, 6, 7], params, rid="behind")

            async with trio.open_nursery() as n:
                n.start_soon(one)
                with trio.fail_after(60):  # it asked the generator for its version, twice
                    while len(reads) < 3:
                        reads.add(g.version_read_at)
                        await trio.sleep(0.01)
                assert "c" not in out and not _running(engine, "behind")
                assert pool.stats()["generators_within_bound"] == 0
                await trio.to_thread.run_sync(set_label, engine.url, "3")  # the broadcaster
            # nothing within the bound before the timeout: an error that says why
            pool.timeout_s, pool.min_version = 0.5, 9
            with pytest.raises(GeneratorError, match=r"version bound.*holds v3; .*v9 or newer"):
                await pool.generate([5, 6, 7], params)
            return out["c"], g.version

    with caplog.at_level("INFO", logger="asyncrl.rollout.generator_pool"):
        c, held = trio.run(go)
    assert held == 3 and c.versions == [3] * len(c.output_ids)
    waiting = caplog.text.index(f"waiting for the learner's weights: {engine.url} holds v0")
    # and the log says when the wait ended, once, after it began
    assert caplog.text.count("the learner's weights arrived: generating at v3") == 1
    assert caplog.text.index("the learner's weights arrived") > waiting


def test_tokens_without_a_version_are_refused_and_the_request_resubmitted(engine):
    """The generator lost its label behind the pool's back (as a restarted server would): its
    response's tokens are refused and counted, it serves nothing until it states a version again,
    and the request, resubmitted, equals one clean completion."""
    import trio

    from asyncrl.rollout.generator_pool import GeneratorPool

    params = SamplingParams(max_new_tokens=8, temperature=0.0)

    async def go():
        async with GeneratorPool([engine.url], version_poll_s=0.05) as pool:
            await pool.label()
            ref = await pool.generate([5, 6, 7], params)
            g = pool.generators[engine.url]
            await trio.to_thread.run_sync(set_label, engine.url, "default")
            out = {}

            async def one():
                out["c"] = await pool.generate([5, 6, 7], params)

            async with trio.open_nursery() as n:
                n.start_soon(one)
                with trio.fail_after(60):
                    while g.unlabelled == 0:
                        await trio.sleep(0.01)
                assert g.version is None and "c" not in out
                await trio.to_thread.run_sync(set_label, engine.url, "4")  # the broadcaster
            return ref, out["c"], pool.stats()

    ref, c, stats = trio.run(go)
    assert stats["responses_unlabelled"] == 1
    assert c.output_ids == ref.output_ids and c.versions == [4] * len(c.output_ids)
    assert_logits_close(c.logprobs, ref.logprobs)
