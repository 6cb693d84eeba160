"""The built-in engine serves LoRA adapters sent by the real weight broadcaster (adapter tensors
only, over a real gloo group) or loaded from a PEFT folder: it generates, and returns logprobs, as
transformers + PEFT do with the same adapter; each version is base + its own delta; a restarted
engine starts at the adapter export; full weights and adapters are never mixed up."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM

from asyncrl import wire
from asyncrl.engine import EngineConfig, serve, start_engine_process
from asyncrl.engine.lora_serving import PEFT_PREFIX
from asyncrl.recipe import WeightsConfig
from asyncrl.weights import buckets, rendezvous
from asyncrl.weights.broadcaster import WeightBroadcaster
from asyncrl.weights.exports import VERSION_FILE, latest_export
from tests.engine_streams import PostInThread
from tests.numerics import assert_logits_close

pytestmark = (
    pytest.mark.numerics
)  # compares float32 logprobs with transformers' (tests/numerics.py)

RANK, ALPHA = 4, 8.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46]]
N = 12


def peft_model(base, seed: int):
    """transformers + PEFT with a random non-zero adapter (B too: a fresh PEFT B is zero), and the
    adapter under the wire contract's names (PEFT's own state dict, its prefix stripped)."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0)
    pm = get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    pm.eval()
    named = {
        k.removeprefix(PEFT_PREFIX): v.detach().clone()
        for k, v in get_peft_model_state_dict(pm).items()
    }
    assert len(named) == 2 * len(TARGETS) * pm.config.num_hidden_layers
    return pm, named


def generate(url: str, prompt: list[int]) -> dict:
    sp = {"max_new_tokens": N, "temperature": 0.0, "ignore_eos": True}
    body = {"input_ids": prompt, "sampling_params": sp, "return_logprob": True}
    r = httpx.post(url + "/generate", json=body, timeout=60)
    r.raise_for_status()
    return r.json()


@torch.no_grad()
def assert_serves(url: str, pm) -> list[list[int]]:
    """Greedy tokens equal PEFT's argmax and logprobs its log-softmax, at every output position."""
    outs = []
    for prompt in PROMPTS:
        res = generate(url, prompt)
        out = res["output_ids"]
        lps = torch.tensor([lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]])
        logits = pm(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
        ref = torch.log_softmax(logits.float(), -1)
        assert ref.argmax(-1).tolist() == out
        assert_logits_close(lps, ref.gather(1, torch.tensor(out)[:, None])[:, 0])
        outs.append(out)
    return outs


def weight(url: str, name: str) -> torch.Tensor:
    r = httpx.post(url + "/get_weights_by_name", json={"name": name, "truncate_size": 10**6})
    return torch.tensor(r.json())


@pytest.fixture(scope="module")
def lora_engine(tiny_qwen3):
    ep = start_engine_process(
        tiny_qwen3, weight_version="0", lora_rank=RANK, lora_alpha=ALPHA, timeout_s=120
    )
    yield ep
    assert ep.stop() == 0


def test_adapters_over_the_broadcaster_serve_as_peft(lora_engine, tiny_qwen3, tmp_path):
    url = lora_engine.url
    info = httpx.get(url + "/server_info", timeout=30).json()
    assert info["enable_lora"] and info["max_lora_rank"] == RANK
    base_out = [generate(url, p)["output_ids"] for p in PROMPTS]
    q = "model.layers.1.self_attn.q_proj"
    w0 = weight(url, f"{q}.weight")
    cfg = WeightsConfig(
        timeout_s=30.0, bucket_mb=0.01, load_format="flattened_bucket", verify="full"
    )
    b = WeightBroadcaster(cfg, export_dir=tmp_path)
    b.add_generator(wire.GeneratorInfo(url=url, kind="builtin"))
    deltas = {}
    try:
        for v in (1, 2, 3):  # 3: merged into version 1's memory (Adapters.installed)
            pm, named = peft_model(tiny_qwen3, seed=v)
            b.publish(v, named)
            assert b.wait(timeout=120)
            r = b.reports[-1]
            assert not r.error and r.updated == [url] and r.reported == {url: str(v)}
            # the engine's checksum covers the adapter it serves: it equals what was sent
            assert r.checksum_ok == {url: True}
            assert r.nbytes == sum(t.numel() * 4 for t in named.values()) > 0
            outs = assert_serves(url, pm)
            if v == 1:
                assert outs != base_out  # the adapter really changed what is generated
            a, bb = named[f"{q}.lora_A.weight"], named[f"{q}.lora_B.weight"]
            deltas[v] = (ALPHA / RANK) * bb @ a
            # each version is base + its own delta, not the previous version's weights + delta
            w = weight(url, f"{q}.weight")
            assert torch.allclose(w, w0 + deltas[v], atol=1e-6)
            if v > 1:
                assert not torch.allclose(w, w0 + deltas[v - 1] + deltas[v], atol=1e-3)
    finally:
        b.close()

    # the learner's `export: adapter` folder (PEFT's save_pretrained + the version file), from disk
    pm4, named4 = peft_model(tiny_qwen3, seed=4)
    folder = tmp_path / "hf" / "v4"
    pm4.save_pretrained(folder)
    (folder / VERSION_FILE).write_text(json.dumps({"version": 4}))
    assert latest_export(tmp_path / "hf") == (folder, 4)
    r = httpx.post(
        url + "/update_weights_from_disk",
        json={"model_path": str(folder), "weight_version": "4"},
        timeout=60,
    )
    assert r.json()["success"], r.text
    assert httpx.get(url + "/model_info").json()["weight_version"] == "4"
    out4 = assert_serves(url, pm4)
    chk = httpx.post(url + "/weights_checker", json={"action": "checksum"}).json()
    assert chk["checksum"] == buckets.checksum(named4.items())

    # a restarted engine (the worker's engine start from the latest export): base + that adapter
    with start_engine_process(
        tiny_qwen3, weight_version="4", lora_rank=RANK, lora_alpha=ALPHA, weights=folder
    ) as fresh:
        assert [generate(fresh.url, p)["output_ids"] for p in PROMPTS] == out4
        assert httpx.get(fresh.url + "/model_info").json()["weight_version"] == "4"


def test_full_weights_and_adapters_are_not_mixed(lora_engine, tiny_qwen3, tmp_path):
    """A LoRA engine refuses a full-weight tensor, an engine without LoRA refuses an adapter (over
    the wire and from disk), each with a one-line reason; neither changes what is served."""
    url = lora_engine.url
    client = httpx.Client(base_url=url, timeout=120)
    store = rendezvous.host_store("127.0.0.1", 300)  # listening before the engine is told the port
    port, group = store.port, "lora_refusal"
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1}
    init |= {"world_size": 2, "group_name": group, "backend": "gloo"}
    call = PostInThread(client, "/init_weights_update_group", init)
    pg = rendezvous.init_custom_process_group(
        master_address="127.0.0.1", master_port=port, rank=0, world_size=2, group_name=group
    )
    del store
    assert call.join().json()["success"]
    try:
        before = generate(url, PROMPTS[0])["output_ids"]
        assert client.post("/begin_weight_update", json={}).json()["success"]
        t = torch.zeros(128)
        bk = buckets.Bucket(names=["model.norm.weight"], tensors=[t])
        call = PostInThread(
            client, "/update_weights_from_distributed", {**bk.meta(), "group_name": group}
        )
        torch.distributed.broadcast(t, src=0, group=pg)
        r = call.join()
        assert r.status_code == 400
        msg = r.json()["message"]
        assert "model.norm.weight: not a LoRA adapter tensor" in msg and "\n" not in msg
        assert generate(url, PROMPTS[0])["output_ids"] == before
    finally:
        client.post("/destroy_weights_update_group", json={"group_name": group})
        rendezvous.destroy_process_group(pg)
        client.close()

    pm, named = peft_model(tiny_qwen3, seed=4)
    peft_dir, plain = tmp_path / "peft", tmp_path / "plain"
    pm.save_pretrained(peft_dir)
    plain.mkdir()
    from safetensors.torch import save_file

    save_file(named, str(plain / "model.safetensors"))
    with serve(EngineConfig(model=str(tiny_qwen3))) as srv:
        for folder, want in (
            (peft_dir, "is a LoRA adapter folder, but this engine was started without --lora-rank"),
            (plain, "a LoRA adapter tensor, but this engine was started without --lora-rank"),
        ):
            r = httpx.post(srv.url + "/update_weights_from_disk", json={"model_path": str(folder)})
            assert r.status_code == 400 and want in r.json()["message"], r.text
