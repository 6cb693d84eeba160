"""The built-in engine serving a Qwen3-MoE (issue #55): its parameters carry the checkpoint's expert
names, so a learner's broadcast (HF names, one tensor per expert) over a real gloo group swaps in,
and the engine (a child process, rank 1) then generates what transformers generates with those
weights."""

from __future__ import annotations

import shutil

import httpx
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from asyncrl.engine import start_engine_process
from asyncrl.weights import buckets
from tests.engine_streams import PostInThread, weight_group

pytestmark = (
    pytest.mark.numerics
)  # greedy tokens of two float32 implementations (tests/numerics.py)

GROUP = "moe_weights"
PROMPT = [5, 6, 7, 8, 9]


def _greedy(url: str, prompt: list[int], n: int = 12) -> list[int]:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }
    return httpx.post(url + "/generate", json=body, timeout=120).json()["output_ids"]


def _hf_greedy(folder, prompt: list[int], n: int = 12) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_engine_takes_expert_weights_under_hf_names(tiny_qwen3_moe, tmp_path):
    original = load_file(str(tiny_qwen3_moe / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in original.items()}
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in new
    # the reference: the same weights as an HF folder, read by transformers' Qwen3MoeForCausalLM
    ref = tmp_path / "ref"
    shutil.copytree(tiny_qwen3_moe, ref)
    save_file(new, str(ref / "model.safetensors"), metadata={"format": "pt"})
    want = _hf_greedy(ref, PROMPT)
    srv = start_engine_process(tiny_qwen3_moe, port=0, timeout_s=120)  # rank 1 of the group
    try:
        client = httpx.Client(base_url=srv.url, timeout=120)
        before = _greedy(srv.url, PROMPT)
        assert before == _hf_greedy(tiny_qwen3_moe, PROMPT)
        with weight_group(client, GROUP) as pg:
            assert client.post("/begin_weight_update", json={}).json()["success"]
            named = sorted(new.items())
            b = buckets.Bucket(names=[n for n, _ in named], tensors=[t for _, t in named])
            meta = {**b.meta(), "group_name": GROUP, "load_format": "flattened_bucket"}
            send = PostInThread(client, "/update_weights_from_distributed", meta)
            dist.broadcast(buckets.flatten(b.tensors), src=0, group=pg)
            r = send.join()
            assert r.status_code == 200 and r.json()["success"], r.text
            end = client.post("/end_weight_update", json={"weight_version": "v1"}).json()
            assert end["success"], end
            chk = client.post("/weights_checker", json={"action": "checksum"}).json()
            assert chk["checksum"] == buckets.checksum(named)
            got = client.post(
                "/get_weights_by_name",
                json={"name": "model.layers.0.mlp.experts.3.down_proj.weight"},
            ).json()
            assert torch.equal(
                torch.tensor(got), new["model.layers.0.mlp.experts.3.down_proj.weight"][:100]
            )
            after = _greedy(srv.url, PROMPT)
            assert after == want and after != before
        client.close()
    finally:
        assert srv.stop() == 0
