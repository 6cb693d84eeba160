"""The built-in engine's /generate and info endpoints against recorded real SGLang 0.5.23 responses,
and its answers to bad input (served in-process over real HTTP)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from asyncrl.engine import EngineConfig, serve
from tests.json_shape import json_shape

RECORDED = Path(__file__).parents[1] / "data" / "sglang-recorded"  # real SGLang 0.5.23 responses


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    srv = serve(EngineConfig(model=str(tiny_qwen3), max_batch_size=16))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(engine):
    with httpx.Client(base_url=engine.url, timeout=60) as c:
        yield c


def _recorded_json(name: str) -> dict:
    return json.loads((RECORDED / name).read_text())


def test_generate_logprob_matches_recorded_shape(client):
    rec = _recorded_json("generate_logprob.json")
    body = {
        "input_ids": [5, 6, 7, 8, 9],
        "sampling_params": {"max_new_tokens": 6, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
    }
    ours = client.post("/generate", json=body).json()
    assert set(ours) == set(rec)
    assert set(ours["meta_info"]) == set(rec["meta_info"])
    for key in (
        "output_token_logprobs",
        "input_top_logprobs",
        "output_top_logprobs",
        "weight_versions",
    ):
        assert json_shape(ours["meta_info"][key]) == json_shape(rec["meta_info"][key]), key
    m = ours["meta_info"]
    assert m["input_token_logprobs"][0] == [None, 5, None]
    assert json_shape(m["input_token_logprobs"][1]) == json_shape(
        rec["meta_info"]["input_token_logprobs"][1]
    )
    assert m["finish_reason"] == {"type": "length", "length": 6}
    assert m["prompt_tokens"] == 5 and m["completion_tokens"] == 6
    assert [t for _, t, _ in m["output_token_logprobs"]] == ours["output_ids"]
    assert m["weight_versions"] == [{"version": "default", "start": 0, "end": 6}]
    assert m["weight_version"] == "default"
    # top-2 entries are sorted and the sampled token's logprob is at most the best one
    for (lp, _, _), top in zip(m["output_token_logprobs"], m["output_top_logprobs"], strict=True):
        assert top[0][0] >= top[1][0] and lp <= top[0][0] + 1e-6


def test_generate_without_logprob_has_no_logprob_fields(client):
    ours = client.post("/generate", json={"text": "ab", "sampling_params": {"max_new_tokens": 2}})
    assert ours.status_code == 200
    assert "output_token_logprobs" not in ours.json()["meta_info"]


def test_stream_matches_recorded_chunks(client):
    rec = [
        json.loads(line[6:])
        for line in (RECORDED / "generate_stream.txt").read_text().splitlines()
        if line.startswith("data: {")
    ]
    body = {
        "input_ids": [5, 6, 7, 8, 9],
        "sampling_params": {"max_new_tokens": 4},
        "return_logprob": True,
        "stream": True,
    }
    with client.stream("POST", "/generate", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert len(chunks) == 4
    for i, (c, rc) in enumerate(zip(chunks, rec, strict=True)):
        skip = {
            "cached_tokens_details"
        }  # a prefix-cache dict in SGLang, null here (no prefix cache)
        assert set(c["meta_info"]) - skip == set(rc["meta_info"]) - skip, i
        assert len(c["output_ids"]) == i + 1  # cumulative, not deltas
        assert c["meta_info"]["completion_tokens"] == i + 1
        assert len(c["meta_info"]["output_token_logprobs"]) == i + 1
    assert chunks[-1]["output_ids"][:3] == chunks[2]["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert chunks[0]["meta_info"]["finish_reason"] is None


def test_unknown_sampling_key_is_rejected_like_sglang(client):
    text = (RECORDED / "generate_bad_sampling_key.txt").read_text().splitlines()
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"logprobs": 3}})
    assert r.status_code == 400
    assert r.json() == json.loads(text[0])


def test_model_info_has_sglang_fields(client, tiny_qwen3):
    rec = _recorded_json("model_info.json")
    ours = client.get("/model_info").json()
    missing = (
        set(rec) - set(ours) - {"embedding"}
    )  # embedding-model config; we serve only generation
    assert not missing
    assert ours["weight_version"] == "default"
    assert ours["architectures"] == ["Qwen3ForCausalLM"] and ours["model_type"] == "qwen3"
    assert ours["model_path"] == str(tiny_qwen3)


def test_health_endpoints(client):
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200


def test_batch_returns_a_list_in_order_with_rids(client):
    body = {
        "input_ids": [[5, 6], [7, 8, 9, 10], [11]],
        "rid": ["a", "b", "c"],
        "sampling_params": [{"max_new_tokens": n, "temperature": 0} for n in (1, 3, 2)],
    }
    out = client.post("/generate", json=body).json()
    assert [o["meta_info"]["id"] for o in out] == ["a", "b", "c"]
    assert [o["meta_info"]["completion_tokens"] for o in out] == [1, 3, 2]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [2, 4, 1]


def test_n_samples_per_prompt(client):
    body = {"text": "xy", "sampling_params": {"max_new_tokens": 3, "n": 3}}
    out = client.post("/generate", json=body).json()
    assert isinstance(out, list) and len(out) == 3
    assert all(o["meta_info"]["completion_tokens"] == 3 for o in out)


def test_stop_token_ids_and_stop_strings(client):
    greedy = client.post(
        "/generate",
        json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
    ).json()
    ids = greedy["output_ids"]
    stop_tok = ids[2]
    first = ids.index(stop_tok)
    r = client.post(
        "/generate",
        json={
            "input_ids": [5, 6, 7],
            "sampling_params": {
                "max_new_tokens": 8,
                "temperature": 0,
                "stop_token_ids": [stop_tok],
            },
        },
    ).json()
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    assert r["output_ids"] == ids[: first + 1]  # the stop token is kept in output_ids
    stop_str = greedy["text"][3:5]
    r = client.post(
        "/generate",
        json={
            "input_ids": [5, 6, 7],
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "stop": stop_str},
        },
    ).json()
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_str}
    assert stop_str not in r["text"] and greedy["text"].startswith(r["text"])


def test_ignore_eos_and_min_new_tokens(client, tiny_qwen3):
    eos = 1  # tools/make_tiny_model.py: <pad>=0, <eos>=1
    bias = {"logit_bias": {str(eos): 100.0}, "temperature": 0}
    r = client.post(
        "/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 5, **bias}}
    ).json()
    assert r["output_ids"] == [eos] and r["meta_info"]["finish_reason"] == {
        "type": "stop",
        "matched": eos,
    }
    r = client.post(
        "/generate",
        json={
            "input_ids": [5],
            "sampling_params": {"max_new_tokens": 5, "ignore_eos": True, **bias},
        },
    ).json()
    assert r["output_ids"] == [eos] * 5 and r["meta_info"]["finish_reason"]["type"] == "length"
    r = client.post(
        "/generate",
        json={
            "input_ids": [5],
            "sampling_params": {"max_new_tokens": 5, "min_new_tokens": 3, **bias},
        },
    ).json()
    assert (
        len(r["output_ids"]) == 4 and r["output_ids"][3] == eos and eos not in r["output_ids"][:3]
    )


def test_sampling_seed_is_reproducible(client):
    body = {
        "text": "q",
        "sampling_params": {"max_new_tokens": 12, "sampling_seed": 7, "top_k": 20, "top_p": 0.9},
    }
    a = client.post("/generate", json=body).json()["output_ids"]
    b = client.post("/generate", json=body).json()["output_ids"]
    assert a == b


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"text": "x", "sampling_params": {"temperature": "hot"}}, "temperature"),
        ({"text": "x", "sampling_params": {"top_p": 0}}, "top_p"),
        ({"text": "x", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"text": "x", "sampling_params": {"repetition_penalty": 1.3}}, "repetition_penalty"),
        ({"input_ids": [1, "a"]}, "input_ids"),
        ({"input_ids": [10**9]}, "vocabulary"),
        ({}, "text"),
        ({"text": "x", "input_ids": [1]}, "text"),
        ({"input_ids": [5] * 600}, "context length"),
        ({"input_ids": [5] * 500, "sampling_params": {"max_new_tokens": 100}}, "context length"),
        ({"text": "x", "stream": "yes"}, "stream"),
    ],
)
def test_bad_generate_requests_get_400_and_engine_keeps_serving(client, body, needle):
    r = client.post("/generate", json=body)
    assert r.status_code == 400
    assert needle in json.dumps(r.json())
    ok = client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}})
    assert ok.status_code == 200


def test_malformed_json_and_unknown_endpoint(client):
    r = client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = client.post("/generate", content=b"[1, 2]")
    assert r.status_code == 400
    assert client.get("/no_such_thing").status_code == 404
    assert client.get("/health").status_code == 200


def test_openai_completions_and_models_match_recorded_shape(client, tiny_qwen3):
    probe = _recorded_json("inflight_probe.json")
    rec_models, rec_comp = probe["v1_models"], probe["v1_completions"][1]
    models = client.get("/v1/models").json()
    assert json_shape(models) == json_shape(rec_models)
    name = models["data"][0]["id"]
    assert name == str(tiny_qwen3)
    body = {"model": name, "prompt": "ab", "max_tokens": 3, "logprobs": 1, "temperature": 0}
    ours = client.post("/v1/completions", json=body).json()
    assert set(ours) == set(rec_comp)
    assert set(ours["choices"][0]) == set(rec_comp["choices"][0])
    assert set(ours["choices"][0]["logprobs"]) == set(rec_comp["choices"][0]["logprobs"])
    assert set(ours["metadata"]) == set(rec_comp["metadata"])
    assert (
        ours["usage"]["completion_tokens"] == 3 and ours["choices"][0]["finish_reason"] == "length"
    )
    gen = client.post(
        "/generate", json={"text": "ab", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    ).json()
    assert ours["choices"][0]["text"] == gen["text"]


def test_openai_unknown_model_is_404(client):
    r = client.post("/v1/completions", json={"model": "gpt-nope", "prompt": "ab", "max_tokens": 2})
    assert r.status_code == 404 and "gpt-nope" in r.json()["message"]


def test_return_prompt_token_ids(client):
    body = {
        "text": "abc",
        "sampling_params": {"max_new_tokens": 1},
        "return_prompt_token_ids": True,
    }
    out = client.post("/generate", json=body).json()
    assert len(out["prompt_token_ids"]) == out["meta_info"]["prompt_tokens"] == 3
