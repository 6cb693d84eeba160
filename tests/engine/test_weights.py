"""Drive the engine as a trainer drives SGLang: this process is rank 0 of a real gloo group, the
engine (a child process) is rank 1, joined over HTTP with SGLang's rendezvous."""

from __future__ import annotations

import httpx
import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.engine import EngineConfig, serve, start_engine_process
from asyncrl.weights import buckets
from tests.engine_streams import GenerateStream, PostInThread, weight_group

GROUP = "weight_update_group"


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    """The engine as a child process (start_engine_process: port 0 + port file, waits on /health)."""
    ep = start_engine_process(tiny_qwen3, port=0, timeout_s=120)
    yield ep
    assert ep.stop() == 0 and not ep.alive()  # SIGTERM: clean exit


def test_engine_process_is_up_on_a_free_port(engine, tiny_qwen3):
    assert engine.port > 0 and engine.alive()
    info = httpx.get(engine.url + "/model_info", timeout=30).json()
    assert info["model_path"] == str(tiny_qwen3) and info["architectures"] == ["Qwen3ForCausalLM"]


@pytest.fixture(scope="module")
def trainer(engine):
    """Join the engine's weight group as rank 0; yields (client, process group)."""
    client = httpx.Client(base_url=engine.url, timeout=120)
    with weight_group(client, GROUP) as pg:
        yield client, pg
    client.close()


def _new_weights(path, seed: int) -> list[tuple[str, torch.Tensor]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    return [
        (n, p.detach() + 0.05 * torch.randn(p.shape, generator=g))
        for n, p in model.named_parameters()
    ]


def _send(
    client, pg, named, *, version, flattened: bool, flush_cache: bool = False
) -> httpx.Response:
    b = buckets.Bucket(names=[n for n, _ in named], tensors=[t for _, t in named])
    body = {**b.meta(), "group_name": GROUP, "flush_cache": flush_cache}
    if version:
        body["weight_version"] = version
    if flattened:
        body["load_format"] = "flattened_bucket"
    call = PostInThread(client, "/update_weights_from_distributed", body)
    if flattened:
        dist.broadcast(buckets.flatten(b.tensors), src=0, group=pg)
    else:
        for t in b.tensors:
            dist.broadcast(t.contiguous(), src=0, group=pg)
    return call.join()


def _greedy(url: str, prompt: list[int], n: int = 16) -> list[int]:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }
    return httpx.post(url + "/generate", json=body, timeout=60).json()["output_ids"]


def test_update_requires_a_session_and_consumes_nothing(trainer):
    client, _ = trainer
    body = {
        "names": ["model.norm.weight"],
        "dtypes": ["float32"],
        "shapes": [[128]],
        "group_name": GROUP,
    }
    r = client.post("/update_weights_from_distributed", json=body)
    assert r.status_code == 400
    assert r.json() == {
        "success": False,
        "message": "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()",
    }
    # no broadcast is pending: the next session's update (in the test below) must line up exactly
    assert client.post("/end_weight_update", json={}).status_code == 400
    r1 = client.post("/begin_weight_update", json={})
    r2 = client.post("/begin_weight_update", json={})
    assert r1.json()["success"] and r2.status_code == 400 and not r2.json()["success"]
    assert client.post("/end_weight_update", json={}).json()["success"]


def test_a_failed_update_discards_the_session_and_keeps_serving(trainer, engine):
    client, pg = trainer
    before = client.post("/get_weights_by_name", json={"name": "model.norm.weight"}).json()
    assert client.post("/begin_weight_update", json={}).json()["success"]
    good = ("model.norm.weight", torch.zeros(128))
    r = _send(client, pg, [good], version=None, flattened=False)
    assert r.status_code == 200
    r = _send(client, pg, [("model.no_such.weight", torch.zeros(3))], version="bad", flattened=True)
    assert r.status_code == 400 and "model.no_such.weight" in r.json()["message"]
    assert client.post("/end_weight_update", json={}).status_code == 400  # session already closed
    assert client.post("/get_weights_by_name", json={"name": "model.norm.weight"}).json() == before
    assert client.get("/model_info").json()["weight_version"] == "default"


def test_update_while_generating_without_pause(trainer, engine, tiny_qwen3, tmp_path):
    client, pg = trainer
    prompt = [5, 6, 7, 8]
    before = _greedy(engine.url, prompt)
    new = _new_weights(tiny_qwen3, seed=1)
    long_body = {
        "input_ids": [9, 10, 11],
        "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
    }
    # decoding during the receive
    a = GenerateStream(engine.url, {**long_body, "rid": "inflight-a"})
    assert a.first.wait(60)
    assert client.post("/begin_weight_update", json={}).json()["success"]
    half = len(new) // 2
    r = _send(client, pg, new[:half], version=None, flattened=False)
    assert r.status_code == 200 and r.json() == {
        "success": True,
        "message": "Succeeded to update parameter online.",
    }
    r = _send(client, pg, new[half:], version="v1", flattened=True)
    assert r.json() == {
        "success": True,
        "message": "Succeeded to update parameter online. Weight version updated to v1.",
    }
    # certainly in flight at the swap
    b = GenerateStream(engine.url, {**long_body, "rid": "inflight-b"})
    assert b.first.wait(60)
    end = client.post("/end_weight_update", json={}).json()
    assert end["success"] and end["weight_version"] == "v1" and end["pause_s"] < 1.0
    res_a, res_b = a.result(), b.result()
    for res in (res_a, res_b):
        m = res["meta_info"]
        assert m["finish_reason"] == {"type": "length", "length": 400}  # completed, not aborted
        spans = m["weight_versions"]
        assert spans[0]["start"] == 0 and spans[-1]["end"] == 400
        assert all(x["end"] == y["start"] for x, y in zip(spans, spans[1:], strict=False))
        assert m["weight_version"] == spans[-1]["version"]
    spans_b = res_b["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans_b] == ["default", "v1"] and 0 < spans_b[0]["end"] < 400
    assert res_b["meta_info"]["num_retractions"] == 0
    assert client.get("/model_info").json()["weight_version"] == "v1"
    # the engine now holds exactly the sent tensors
    sent = dict(new)
    for name in (
        "model.embed_tokens.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.norm.weight",
    ):
        got = torch.tensor(client.post("/get_weights_by_name", json={"name": name}).json())
        assert torch.equal(got, sent[name][:100])
    lm_head = torch.tensor(
        client.post(
            "/get_weights_by_name", json={"name": "lm_head.weight", "truncate_size": 3}
        ).json()
    )
    assert torch.equal(lm_head, sent["model.embed_tokens.weight"][:3])  # tied
    chk = client.post("/weights_checker", json={"action": "checksum"}).json()
    assert chk["success"] and chk["checksum"] == buckets.checksum(new)
    sampled = client.post("/weights_checker", json={"action": "checksum", "sample": 64}).json()
    assert sampled["checksum"] == buckets.checksum(new, sample=64) != chk["checksum"]
    bad = client.post("/weights_checker", json={"action": "checksum", "sample": -1})
    assert bad.status_code == 400 and "`sample`" in bad.text
    # and generates exactly like a fresh engine loaded with the new weights
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    model.load_state_dict(sent, strict=False)
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_qwen3).save_pretrained(tmp_path)
    after = _greedy(engine.url, prompt)
    assert after != before
    with serve(EngineConfig(model=str(tmp_path))) as fresh:
        assert _greedy(fresh.url, prompt) == after
    # /update_weights_from_disk puts the original weights back, under a new version
    r = client.post(
        "/update_weights_from_disk", json={"model_path": str(tiny_qwen3), "weight_version": "v2"}
    )
    assert r.json()["success"] and r.json()["message"].endswith("Weight version updated to v2.")
    assert _greedy(engine.url, prompt) == before


def test_flush_cache_true_with_requests_resident_is_400_after_loading(trainer, engine, tiny_qwen3):
    client, pg = trainer
    new = _new_weights(tiny_qwen3, seed=2)
    body = {"input_ids": [9, 10], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    s = GenerateStream(engine.url, body)
    assert s.first.wait(60)
    # SGLang's verified case: paused in place, so the request is certainly resident during the update
    assert client.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    assert client.post("/begin_weight_update", json={}).json()["success"]
    r = _send(client, pg, new, version="v3", flattened=True, flush_cache=True)
    assert r.status_code == 400 and r.json()["message"].startswith(
        "Weights were updated, but the cache"
    )
    assert client.post("/end_weight_update", json={}).json()["success"]
    assert client.get("/model_info").json()["weight_version"] == "v3"  # loaded anyway
    got = client.post("/get_weights_by_name", json={"name": "model.norm.weight"}).json()
    assert torch.equal(torch.tensor(got), dict(new)["model.norm.weight"][:100])
    assert client.post("/continue_generation", json={}).status_code == 200
    m = s.result()["meta_info"]
    assert m["finish_reason"]["type"] == "length" and m["weight_versions"][-1]["version"] == "v3"
    # idle now: flush_cache true succeeds
    assert client.post("/begin_weight_update", json={}).json()["success"]
    r = _send(client, pg, new[:1], version="v4", flattened=False, flush_cache=True)
    assert r.status_code == 200, r.text
    assert client.post("/end_weight_update", json={}).json()["success"]


def test_update_weight_version_aborts_by_default(trainer, engine):
    client, _ = trainer
    body = {"input_ids": [9, 10], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    s = GenerateStream(engine.url, body)
    assert s.first.wait(60)
    r = client.post("/update_weight_version", json={"new_version": "v5"}).json()
    assert r == {"success": True, "message": "Weight version updated to v5", "new_version": "v5"}
    m = s.result()["meta_info"]
    assert m["finish_reason"]["type"] == "abort"
    s = GenerateStream(engine.url, body)
    assert s.first.wait(60)
    client.post("/update_weight_version", json={"new_version": "v6", "abort_all_requests": False})
    m = s.result()["meta_info"]
    assert m["finish_reason"]["type"] == "length"
    assert [x["version"] for x in m["weight_versions"]] == ["v5", "v6"]
