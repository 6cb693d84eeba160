"""Pause modes, continue, abort and flush on the built-in engine, as SGLang 0.5.23 defines them.

Every check reads the engine's own state (/engine_stats) or compares token sequences, so none
depends on timing: a paused decode loop cannot take steps, whatever the machine's load.
"""

from __future__ import annotations

import json
import random
import threading

import httpx
import pytest

from asyncrl.engine import EngineConfig, serve
from tests.engine_streams import GenerateStream

LONG = {
    "input_ids": [9, 10, 11],
    "sampling_params": {"max_new_tokens": 480, "temperature": 0, "ignore_eos": True},
}


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    with serve(EngineConfig(model=str(tiny_qwen3), weight_version="w0")) as srv:
        yield srv


@pytest.fixture
def client(engine):
    with httpx.Client(base_url=engine.url, timeout=120) as c:
        yield c
        c.post("/continue_generation", json={})


def started_stream(url: str, body: dict) -> GenerateStream:
    """A streaming request that has produced its first token."""
    s = GenerateStream(url, body)
    assert s.first.wait(60)
    return s


class Call:
    def __init__(self, url: str, body: dict):
        self.resp = None
        self._t = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self._t.start()

    def _run(self, url, body):
        self.resp = httpx.post(url + "/generate", json=body, timeout=120)

    def result(self) -> dict:
        self._t.join(120)
        return self.resp.json()


def _stats(c):
    return c.get("/engine_stats").json()


def _wait_waiting(c, n):
    """Poll until ``n`` requests are queued (a request in flight over HTTP needs a moment to land)."""
    for _ in range(600):
        if _stats(c)["waiting"] >= n:
            return
        threading.Event().wait(0.05)
    raise AssertionError("request never reached the engine's queue")


@pytest.fixture(scope="module")
def reference(engine):
    return httpx.post(engine.url + "/generate", json=LONG, timeout=120).json()["output_ids"]


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_keeps_requests_and_continue_finishes_them_unchanged(client, engine, reference, mode):
    s = started_stream(engine.url, LONG)
    r = client.post("/pause_generation", json={"mode": mode})
    assert r.json() == {"message": "Generation paused successfully.", "status": "ok"}
    st = _stats(client)
    assert st["paused"] == mode
    if mode == "in_place":
        assert (st["running"], st["waiting"]) == (1, 0)  # frozen with its KV cache
        assert client.get("/flush_cache").status_code == 400
    else:
        assert (st["running"], st["waiting"]) == (0, 1)  # KV dropped, tokens kept
        assert (
            client.get("/flush_cache").status_code == 200
        )  # SGLang ignores the waiting queue here
    held = Call(engine.url, {"input_ids": [5], "sampling_params": {"max_new_tokens": 2}})
    _wait_waiting(client, 1 if mode == "in_place" else 2)
    assert _stats(client)["decode_steps"] == st["decode_steps"]  # no step taken while paused
    assert client.post("/continue_generation", json={}).json() == {
        "message": "Generation continued successfully.",
        "status": "ok",
    }
    res = s.result()
    m = res["meta_info"]
    assert m["finish_reason"] == {"type": "length", "length": 480}
    assert m["num_retractions"] == (1 if mode == "retract" else 0)
    assert res["output_ids"] == reference  # same weights: a pause changes nothing
    assert held.result()["meta_info"]["completion_tokens"] == 2


def test_pause_abort_returns_partial_output_and_holds_new_requests(client, engine, reference):
    s = started_stream(engine.url, LONG)
    assert client.post("/pause_generation", json={}).status_code == 200  # default mode: abort
    res = s.result()
    m = res["meta_info"]
    assert s.status == 200
    assert m["finish_reason"] == {
        "type": "abort",
        "message": "Aborted",
        "status_code": None,
        "err_type": None,
    }
    n = len(res["output_ids"])
    assert 0 < n < 480 and res["output_ids"] == reference[:n]
    assert m["weight_versions"] == [{"version": "w0", "start": 0, "end": n}]  # --weight-version
    assert m["weight_version"] == "w0" == client.get("/model_info").json()["weight_version"]
    held = Call(engine.url, {"input_ids": [5], "sampling_params": {"max_new_tokens": 2}})
    _wait_waiting(client, 1)
    client.post("/continue_generation", json={})
    assert held.result()["meta_info"]["finish_reason"]["type"] == "length"


def test_abort_request_by_rid_prefix_and_abort_all(client, engine):
    a = started_stream(engine.url, {**LONG, "rid": "grp-1"})
    b = started_stream(engine.url, {**LONG, "rid": "grp-2"})
    other = started_stream(engine.url, {**LONG, "rid": "other"})
    r = client.post("/abort_request", json={"rid": "grp-"})
    assert r.status_code == 200 and r.content == b""
    assert a.result()["meta_info"]["finish_reason"]["type"] == "abort"
    assert b.result()["meta_info"]["finish_reason"]["type"] == "abort"
    assert client.get("/flush_cache").status_code == 400  # 'other' still runs
    client.post("/abort_request", json={"abort_all": True})
    assert other.result()["meta_info"]["finish_reason"]["type"] == "abort"
    assert client.get("/flush_cache").status_code == 200


def test_bad_control_requests(client):
    r = client.post("/pause_generation", json={"mode": "freeze"})
    assert r.status_code == 400 and "mode" in r.text
    assert client.post("/abort_request", json={}).status_code == 400
    assert client.post("/update_weight_version", json={}).status_code == 400
    r = client.post("/get_weights_by_name", json={"name": "no.such.weight"})
    assert r.status_code == 400 and "no.such.weight" in r.text
    r = client.post("/init_weights_update_group", json={"master_address": "127.0.0.1"})
    assert (
        r.status_code == 400
        and r.json()["success"] is False
        and "master_port" in r.json()["message"]
    )
    r = client.post("/update_weights_from_disk", json={"model_path": "/no/such/dir"})
    assert r.status_code == 400 and r.json()["success"] is False
    assert client.get("/health").status_code == 200


def test_stream_client_disconnect_aborts_its_request(client, engine):
    steps0 = _stats(client)["decode_steps"]
    with (
        httpx.Client(timeout=60) as c,
        c.stream("POST", engine.url + "/generate", json={**LONG, "stream": True}) as r,
    ):
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # leave after the first chunk: the connection closes with the context
    for _ in range(600):  # the server notices at its next write
        st = _stats(client)
        if st["running"] == 0 and st["waiting"] == 0:
            break
        threading.Event().wait(0.05)
    assert (st["running"], st["waiting"]) == (0, 0)
    assert st["decode_steps"] - steps0 < 479  # stopped early: it did not run to max_new_tokens


def test_mixed_load_with_control_actions_keeps_every_response_consistent(engine, tiny_qwen3):
    """60 requests with random sampling settings, streams and logprobs, while aborts, in-place and
    retract pauses, version bumps and disk reloads hit the engine: every answer is well formed."""
    rng = random.Random(0)
    errors: list[str] = []

    def one(i: int) -> None:
        r = random.Random(i)
        sp: dict = {"max_new_tokens": r.randint(1, 120)}
        for key, p, val in (
            ("temperature", 0.3, lambda: r.choice([0, 0.5, 1.3])),
            ("top_k", 0.3, lambda: r.randint(1, 50)),
            ("top_p", 0.3, lambda: r.uniform(0.1, 1.0)),
            ("stop", 0.3, lambda: [r.choice("abcdefg")]),
            ("stop_token_ids", 0.3, lambda: [r.randint(3, 90)]),
            ("ignore_eos", 0.3, lambda: True),
            ("sampling_seed", 0.2, lambda: r.randint(0, 9)),
            ("n", 0.2, lambda: 2),
        ):
            if r.random() < p:
                sp[key] = val()
        body = {
            "input_ids": [r.randint(3, 90) for _ in range(r.randint(1, 40))],
            "sampling_params": sp,
            "return_logprob": r.random() < 0.5,
            "rid": f"mix{i}",
        }
        try:
            if r.random() < 0.3:
                with (
                    httpx.Client(timeout=120) as c,
                    c.stream(
                        "POST", engine.url + "/generate", json={**body, "stream": True}
                    ) as resp,
                ):
                    outs = [
                        json.loads(x[6:]) for x in resp.iter_lines() if x.startswith("data: {")
                    ][-1:]
            else:
                resp = httpx.post(engine.url + "/generate", json=body, timeout=120)
                outs = resp.json() if isinstance(resp.json(), list) else [resp.json()]
            assert resp.status_code == 200 and outs
            for o in outs:
                m, n = o["meta_info"], len(o["output_ids"])
                assert m["completion_tokens"] == n and m["finish_reason"] is not None
                if body["return_logprob"]:
                    assert [t for _, t, _ in m["output_token_logprobs"]] == o["output_ids"]
                if n:
                    spans = m["weight_versions"]
                    assert spans[0]["start"] == 0 and spans[-1]["end"] == n
                    assert all(
                        a["end"] == b["start"] for a, b in zip(spans, spans[1:], strict=False)
                    )
                if m["finish_reason"]["type"] == "length":
                    assert n == sp["max_new_tokens"]
        except Exception as e:  # collected, so one failure names its request
            errors.append(f"request {i}: {e!r}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(60)]
    for t in threads:
        t.start()
    with httpx.Client(base_url=engine.url, timeout=120) as c:
        for k in range(10):
            act = rng.choice(["abort", "in_place", "retract", "disk", "version"])
            if act == "abort":
                assert (
                    c.post("/abort_request", json={"rid": f"mix{rng.randint(0, 59)}"}).status_code
                    == 200
                )
            elif act in ("in_place", "retract"):
                c.post("/pause_generation", json={"mode": act})
                c.post("/continue_generation", json={})
            elif act == "disk":
                body = {"model_path": str(tiny_qwen3), "weight_version": f"d{k}"}
                assert c.post("/update_weights_from_disk", json=body).json()["success"]
            else:
                c.post(
                    "/update_weight_version",
                    json={"new_version": f"u{k}", "abort_all_requests": False},
                )
        for t in threads:
            t.join(120)
        assert not errors, errors[:3]
        st = c.get("/engine_stats").json()
        assert (st["running"], st["waiting"], st["paused"]) == (0, 0, None)
