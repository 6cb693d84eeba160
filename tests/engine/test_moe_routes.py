"""The built-in engine's routed experts (issue #55): a request with SGLang's
``return_routed_experts`` gets, in ``meta_info.routed_experts``, base64 of int32
``[prompt + completion - 1, num_hidden_layers, top_k]``: the experts transformers' router chooses
for every fed position, the prompt's and each sampled token's but the last, alone and batched."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.engine.api import EngineConfig
from asyncrl.engine.server import serve

pytestmark = pytest.mark.numerics  # top-k of two float32 implementations (tests/numerics.py)

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26]]


@pytest.fixture(scope="module")
def moe_dense_first(tmp_path_factory):
    """Layer 0 dense (``mlp_only_layers``), layers 1-2 MoE; 8 experts, top-2."""
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("moe_routes"),
        arch="qwen3_moe",
        hidden=64,
        layers=3,
        experts=8,
        top_k=2,
        moe_intermediate=32,
        dense_layers=(0,),
        seed=5,
    )


def hf_routes(folder, ids: list[int]) -> np.ndarray:
    """transformers' router top-k for every position of ``ids``, ``[len(ids), layers, top_k]``
    (a dense layer's row zero), read with a hook on each MoE layer's gate."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    cfg = model.config
    out = np.zeros((len(ids), cfg.num_hidden_layers, cfg.num_experts_per_tok), np.int32)
    hooks = []
    for li, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(layer.mlp, "experts"):
            continue

        def grab(_m, _inp, o, li=li):
            out[:, li] = o[2].reshape(len(ids), -1).numpy()

        hooks.append(gate.register_forward_hook(grab))
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return out


def decode_routes(meta: dict, layers: int, top_k: int) -> np.ndarray:
    raw = base64.b64decode(meta["routed_experts"])
    return np.frombuffer(raw, dtype="<i4").reshape(-1, layers, top_k)


def _same_sets(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    assert np.array_equal(np.sort(got, -1), np.sort(want, -1))


def test_engine_returns_the_routes_transformers_chooses(moe_dense_first):
    srv = serve(EngineConfig(model=str(moe_dense_first), max_batch_size=8))
    try:
        url = srv.url + "/generate"
        sp = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 3}
        # alone, then the three prompts batched (one prefill, decode steps over several rows)
        alone = httpx.post(
            url,
            json={"input_ids": PROMPTS[0], "sampling_params": sp, "return_routed_experts": True},
            timeout=120,
        ).json()
        batched = httpx.post(
            url,
            json={"input_ids": PROMPTS, "sampling_params": sp, "return_routed_experts": True},
            timeout=120,
        ).json()
        for prompt, res in zip([PROMPTS[0], *PROMPTS], [alone, *batched], strict=True):
            ids = prompt + res["output_ids"]
            got = decode_routes(res["meta_info"], 3, 2)
            assert got.shape[0] == len(ids) - 1  # the last sampled token is never fed
            assert not got[:, 0].any()  # the dense layer: zeros, as SGLang's zeroed buffer
            _same_sets(got, hf_routes(moe_dense_first, ids)[:-1])
        # SGLang's routed_experts_start_len: the rows from that absolute position on
        res = httpx.post(
            url,
            json={
                "input_ids": PROMPTS[2],
                "sampling_params": sp,
                "return_routed_experts": True,
                "routed_experts_start_len": 4,
            },
            timeout=120,
        ).json()
        ids = PROMPTS[2] + res["output_ids"]
        _same_sets(decode_routes(res["meta_info"], 3, 2), hf_routes(moe_dense_first, ids)[4:-1])
        # not asked: not recorded, not returned
        plain = httpx.post(url, json={"input_ids": PROMPTS[0], "sampling_params": sp}, timeout=120)
        assert "routed_experts" not in plain.json()["meta_info"]
        bad = httpx.post(
            url,
            json={
                "input_ids": PROMPTS[1],
                "sampling_params": sp,
                "return_routed_experts": True,
                "routed_experts_start_len": 4,
            },
            timeout=120,
        )
        assert bad.status_code == 400 and "routed_experts_start_len" in bad.text
    finally:
        srv.stop()


def test_a_dense_model_refuses_return_routed_experts(tiny_qwen3):
    srv = serve(EngineConfig(model=str(tiny_qwen3), max_batch_size=2))
    try:
        r = httpx.post(
            srv.url + "/generate",
            json={
                "input_ids": [5, 6],
                "sampling_params": {"max_new_tokens": 2},
                "return_routed_experts": True,
            },
            timeout=60,
        )
        assert r.status_code == 400 and "return_routed_experts" in r.text
    finally:
        srv.stop()
