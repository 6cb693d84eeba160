"""LoRA on real SGLang 0.5.23 (CPU, ``--enable-lora``, its torch backend): the broadcaster sends
each version's adapter as a PEFT folder SGLang loads by name, the rollout client names the newest
one per request, and what SGLang generates with it is what transformers + PEFT give with that
adapter. A request keeps the adapter it named to its end (SGLang's spans move to the new label when
the next version is loaded; the client's versions stay true)."""

from __future__ import annotations

import time

import httpx
import pytest
import torch
import trio
from conftest import START_TIMEOUT_S
from sglang_helpers import TOL, healthy, label_at_join

from asyncrl import wire
from asyncrl.recipe import LoraConfig, WeightsConfig
from asyncrl.rollout.generator_pool import GeneratorPool
from asyncrl.rollout.sglang_protocol import SamplingParams, parse_generate_response
from asyncrl.weights.broadcaster import WeightBroadcaster
from tests.engine.test_lora_serving import ALPHA, PROMPTS, RANK, TARGETS, peft_model
from tests.engine_streams import GenerateStream
from tools.sglang_cpu.server import SGLangServer, lora_args, lora_env

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def lora_server(sglang_python, tiny_qwen3, tmp_path_factory):
    server = SGLangServer(
        python=sglang_python,
        model=tiny_qwen3,
        log=tmp_path_factory.getbasetemp() / "sglang_lora.log",
        extra_args=["--disable-radix-cache", *lora_args(RANK, TARGETS)],
        env=lora_env(),
    )
    yield from healthy(server, START_TIMEOUT_S)


@torch.no_grad()
def peft_logprobs(pm, prompt: list[int], out: list[int]) -> torch.Tensor:
    """log softmax at every output position, from one transformers + PEFT forward pass."""
    logits = pm(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.double(), -1)


def rollout(url: str, prompt: list[int]):
    """One greedy completion through the rollout client, as a LoRA worker's requests go."""

    async def run():
        async with GeneratorPool([url], timeout_s=300, lora=True) as pool:
            await pool.label()
            params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
            return await pool.generate(prompt, params)

    return trio.run(run)


def assert_peft(c, pm, prompt: list[int]) -> None:
    ref = peft_logprobs(pm, prompt, c.output_ids)
    assert ref.argmax(-1).tolist() == c.output_ids
    got = torch.tensor(c.logprobs, dtype=torch.float64)
    want = ref.gather(1, torch.tensor(c.output_ids)[:, None])[:, 0]
    assert float((got - want).abs().max()) <= TOL


def test_adapter_versions_by_name_serve_as_peft(lora_server, tiny_qwen3, tmp_path):
    url = lora_server.url
    assert label_at_join(url) == 0
    base = [rollout(url, p) for p in PROMPTS]
    assert all(set(c.versions) == {0} for c in base)
    cfg = WeightsConfig(timeout_s=120.0, verify="full")
    b = WeightBroadcaster(cfg, export_dir=tmp_path / "hf", lora=LoraConfig(rank=RANK, alpha=ALPHA))
    b.add_generator(wire.GeneratorInfo(url=url, kind="sglang"))
    models = {}
    long = None
    try:
        for v in (1, 2, 3, 4):
            pm, named = peft_model(tiny_qwen3, seed=v)
            models[v] = pm
            b.publish(v, named)
            assert b.wait(timeout=300)
            if v == 2:  # v2 is loaded and labelled while the long request is held: let it go on
                assert not finished(long), "the long request ended before it was paused"
                assert httpx.post(url + "/continue_generation", json={}, timeout=30).is_success
            r = b.reports[-1]
            assert not r.error and r.updated == [url] and not r.dropped, r
            assert r.reported == {url: str(v)} and r.group_builds == 0  # no weight group
            assert (tmp_path / "adapters" / f"v{v}" / "adapter_config.json").is_file()
            outs = []
            for prompt in PROMPTS:
                c = rollout(url, prompt)
                assert set(c.versions) == {v}
                assert_peft(c, pm, prompt)
                outs.append(c.output_ids)
            if v == 1:
                assert outs != [c.output_ids for c in base]  # the adapter changed the tokens
                # a long request on adapter v1, in flight while v2 is loaded. SGLang holds it in
                # its batch (an in-place pause, as a weight update does) so that it cannot end
                # before v2 is there, however fast this machine decodes
                sp = {"max_new_tokens": 300, "temperature": 0.0, "ignore_eos": True}
                body = {"input_ids": PROMPTS[1], "sampling_params": sp, "lora_path": "v1"}
                long = GenerateStream(url, {**body, "return_logprob": True})
                assert long.first.wait(120)
                pause = httpx.post(url + "/pause_generation", json={"mode": "in_place"}, timeout=30)
                assert pause.is_success, pause.text
        assert long is not None
        final = long.result()
    finally:
        b.close()
    spans = final["meta_info"]["weight_versions"]
    seg = parse_generate_response(final, adapter=1)
    # SGLang moved the label on mid-request, but every token is adapter v1's: PEFT v1's logprobs
    assert [s["version"] for s in spans][-1] in ("2", "3", "4")
    assert len(seg.output_ids) == 300 and set(seg.versions) == {1}
    ref = peft_logprobs(models[1], PROMPTS[1], seg.output_ids)
    assert ref.argmax(-1).tolist() == seg.output_ids
    want = ref.gather(1, torch.tensor(seg.output_ids)[:, None])[:, 0]
    assert float((torch.tensor(seg.logprobs, dtype=torch.float64) - want).abs().max()) <= TOL
    # the adapter two versions back is let go once its requests are done (SGLang's unload waits
    # for them, in the background); the one before stays for requests that still name it
    assert loaded_adapters(url, until=lambda names: names == {"v3", "v4"}) == {"v3", "v4"}
    folders = sorted(d.name for d in (tmp_path / "adapters").iterdir())
    assert folders == ["v2", "v3", "v4"]  # one version longer than SGLang holds the adapter


def finished(stream: GenerateStream) -> bool:
    """Whether the stream's newest chunk carries SGLang's finish reason."""
    return bool(stream.chunks) and stream.chunks[-1]["meta_info"].get("finish_reason") is not None


def loaded_adapters(url: str, until, timeout_s: float = 60.0) -> set[str]:
    """The adapters SGLang lists (``/v1/models``: the base model, then each adapter with its
    ``parent``), asked again until ``until(names)`` holds or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        data = httpx.get(url + "/v1/models", timeout=30).json()["data"]
        names = {m["id"] for m in data if m.get("parent")}
        if until(names) or time.monotonic() > deadline:
            return names
