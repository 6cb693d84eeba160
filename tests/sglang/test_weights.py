"""Weight updates from a learner process into real SGLang 0.5.23 through asyncrl's broadcaster.

The learner side is this test process (asyncrl's .venv, torch 2.13 CPU), rank 0 of a gloo group with
the SGLang scheduler (torch 2.14.1). Each update is checked on the server: ``/model_info`` reports
the version, SGLang's own per-parameter checksums (``/weights_checker``) equal the ones recomputed
from the learner's tensors, ``/get_weights_by_name`` returns the learner's values for every
parameter (Llama; SGLang 0.5.23's Qwen3 model has no such method), and a new sample's logprobs equal a
transformers forward pass with the new weights.
"""

from __future__ import annotations

import uuid

import httpx
import pytest
import torch
import trio
from sglang_helpers import (
    PROMPT,
    TOL,
    Served,
    generate,
    perturbed,
    reference_logprobs,
    sglang_checksums,
)

from asyncrl.generator_http import WeightsClient, async_client
from asyncrl.recipe import WeightsConfig
from asyncrl.rollout.generator_pool import Completion, GeneratorPool
from asyncrl.rollout.sglang_protocol import SamplingParams
from asyncrl.weights.broadcaster import WeightBroadcaster
from asyncrl.weights.sync import SyncReport
from asyncrl.wire import GeneratorInfo

pytestmark = pytest.mark.sglang

BUDGET = 400


def broadcaster(served: Served, on_event=None, **cfg) -> WeightBroadcaster:
    cfg = {"timeout_s": 60.0, "overlap": False, "bucket_mb": 0.5, **cfg}
    b = WeightBroadcaster(
        WeightsConfig(group_name=f"t-{uuid.uuid4().hex[:8]}", **cfg),
        rank=0,
        verify=True,
        on_event=on_event,
    )
    b.add_generator(GeneratorInfo(url=served.url))
    return b


def check_served_weights(served: Served, report: SyncReport | None) -> None:
    """The server holds ``served.weights`` as version ``served.version`` (after set_weights)."""
    url, v = served.url, str(served.version)
    if report is not None:
        assert report.error == "" and report.dropped == [], report
        assert report.updated == [url] and report.reported == {url: v}
        assert report.checksum_ok[url] is not False  # None: SGLang's checksum is not ours
    with httpx.Client(base_url=url, timeout=120) as http:
        assert http.get("/model_info").json()["weight_version"] == v
        chk = http.post("/weights_checker", json={"action": "checksum"}).json()
        assert chk["success"] is True, chk
        per_param, per_engine = sglang_checksums(served.weights, served.tied)
        assert chk["ranks"][0]["checksums"] == per_param
        assert chk["per_engine_checksum"] == per_engine
        if served.name == "llama":  # the only one of the two with get_weights_by_name in 0.5.23
            for name, t in served.weights.items():
                body = {"name": name, "truncate_size": t.shape[0]}
                got = http.post("/get_weights_by_name", json=body).json()
                assert torch.equal(torch.tensor(got, dtype=torch.float32), t), name
    # the model computes with them: a new sample equals transformers with the new weights (the
    # servers run without the radix cache, so no prefix KV of the old weights is reused; the flush
    # is what a server launched with one would need)
    assert httpx.post(url + "/flush_cache", timeout=60).status_code == 200
    c = generate(url, SamplingParams(max_new_tokens=16))
    assert c.versions == [served.version] * len(c.output_ids)
    ref = reference_logprobs(served.reference(), PROMPT, c.output_ids)
    err = (ref - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max().item()
    assert err <= TOL, f"after the update: max |logprob error| {err:.2e}"


async def _update_mid_request(
    served: Served, b: WeightBroadcaster, version: int, weights: dict
) -> tuple[Completion, bool]:
    """Start a long request, publish ``version`` while it decodes; (completion, was it in flight)."""
    done: list[Completion] = []

    async def gen(pool: GeneratorPool) -> None:
        # ignore_eos: a random tiny model may pick EOS early, and the request must outlive the update
        params = SamplingParams(max_new_tokens=BUDGET, ignore_eos=True)
        done.append(await pool.generate(PROMPT, params))

    async with GeneratorPool([served.url], timeout_s=300) as pool:
        await pool.label()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gen, pool)
            in_flight = await served.wait_generating(len(PROMPT) + 16, lambda: bool(done))
            await trio.to_thread.run_sync(b.publish, version, weights)
    return done[0], in_flight


@pytest.mark.parametrize("pause_mode", ["in_place", "retract"])
def test_update_while_a_request_decodes(served: Served, pause_mode: str):
    """The in-flight request is paused (not aborted), finishes with the new weights, and its
    version spans show both versions; the tokens before the update are the old policy's."""
    flushed: list[int] = []

    def flush_while_retracted(name: str, fields: dict) -> None:
        """After the last bucket, while paused: drop the radix cache. Otherwise the retracted
        request's re-prefill reuses prefix KV the old weights computed. The broadcaster sends
        flush_cache: false in every mode (in_place needs it); in retract mode it could flush."""
        if name == "bucket_sent" and fields["index"] == fields["count"] - 1:
            flushed.append(httpx.post(served.url + "/flush_cache", timeout=60).status_code)

    hook = flush_while_retracted if pause_mode == "retract" else None
    b = broadcaster(served, on_event=hook, pause_mode=pause_mode, load_format="flattened_bucket")
    try:
        old, old_weights = served.version, served.weights
        v = old + 1
        new = perturbed(old_weights, seed=1000 + v, tied=served.tied)
        # the weight group is built (and the weights sent as they are) before the request starts:
        # the update in its middle is then pause + buckets only, which lands well within its 400
        # tokens even on a loaded machine (CI once saw a first group build outlast them)
        b.publish(old, old_weights)
        c, in_flight = trio.run(_update_mid_request, served, b, v, new)
        ref_old = reference_logprobs(served.reference(), PROMPT, c.output_ids)
        served.set_weights(v, new)
        check_served_weights(served, b.reports[-1])
    finally:
        b.close()
    assert in_flight, "the request ended before the update"
    n = len(c.output_ids)
    assert v in c.versions, c.versions
    k = c.versions.index(v)
    assert 0 < k < n and c.versions == [old] * k + [v] * (n - k)
    assert c.finish_reason == "length" and n == BUDGET and c.num_resumes == 0
    lps = torch.tensor(c.logprobs, dtype=torch.float64)
    err = (ref_old[:k] - lps[:k]).abs().max().item()
    assert err <= TOL, f"tokens before the update: max |logprob error| {err:.2e}"
    if pause_mode == "in_place":  # kept its KV (computed by the old weights): nothing recomputed
        assert c.num_retractions == 0
    else:  # retracted, cache flushed: its KV is recomputed by the new weights: the rest is exact
        assert c.num_retractions >= 1 and flushed and set(flushed) == {200}
        ref_new = reference_logprobs(served.reference(), PROMPT, c.output_ids)
        err = (ref_new[k:] - lps[k:]).abs().max().item()
        assert err <= TOL, f"tokens after a retract update: max |logprob error| {err:.2e}"


def test_consecutive_versions_reuse_the_group(served: Served):
    """Two versions through one broadcaster, ``list`` load format (the in-flight test sends
    ``flattened_bucket``): the group is built once."""
    b = broadcaster(served, load_format="list", bucket_mb=0.25)
    try:
        for i in range(2):
            v = served.version + 1
            new = perturbed(served.weights, seed=2000 + v, tied=served.tied)
            b.publish(v, new)
            served.set_weights(v, new)
            report = b.reports[-1]
            assert report.group_builds == (1 if i == 0 else 0)
            check_served_weights(served, report)
    finally:
        b.close()


def test_update_by_handle(served: Served):
    """``weights.backend: ipc`` to SGLang (what rank 0 sends a server on its own GPU): each bucket
    through SGLang's own ``/update_weights_from_tensor``, ``load_format: flattened_bucket``, the
    payload asyncrl.weights.ipc builds (on the CPU its handles name shared memory). SGLang's
    unpickler takes it, loads every record and labels the version; no group is built."""
    b = broadcaster(served, backend="ipc", load_format="flattened_bucket", bucket_mb=0.25)
    try:
        v = served.version + 1
        new = perturbed(served.weights, seed=5000 + v, tied=served.tied)
        b.publish(v, new)
        served.set_weights(v, new)
        report = b.reports[-1]
        assert b.groups.backend(served.url) == "ipc" and report.group_builds == 0
        check_served_weights(served, report)
    finally:
        b.close()


def test_update_from_disk(served: Served, tmp_path):
    """What a rejoining generator gets: the latest exported HF checkpoint, loaded from disk with its
    version and without aborting anything (WeightsClient.update_from_disk)."""
    import shutil

    from safetensors.torch import save_file

    v = served.version + 1
    new = perturbed(served.weights, seed=4000 + v, tied=served.tied)
    export = tmp_path / f"step-{v}"
    shutil.copytree(served.model_dir, export)
    sent = {
        k: t.contiguous() for k, t in new.items() if not (served.tied and k == "lm_head.weight")
    }
    save_file(sent, str(export / "model.safetensors"))

    async def load() -> None:
        async with async_client(120) as http:
            client = WeightsClient(GeneratorInfo(url=served.url), http)
            await client.update_from_disk(str(export), weight_version=str(v))

    trio.run(load)
    served.set_weights(v, new)
    check_served_weights(served, None)
