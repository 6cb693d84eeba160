"""Real SGLang's ``/classify`` on a reward model as the learner exports it, against the built-in
engine's: the same response shape, the same scores (and transformers'), and the rollout's model
reward reading them.

The folder is the reward-model learner's own export (a fresh head on a tiny Qwen3), with the zero
``score.bias`` without which SGLang 0.5.23 adds a random offset to every score (its head has a bias
that no HF checkpoint holds: asyncrl.learner.scalar_model.HF_BIAS).
"""

from __future__ import annotations

import httpx
import pytest
import torch
import trio
from sglang_helpers import healthy

from asyncrl import recipe as recipe_mod
from asyncrl.served.model_reward import build_reward
from tests.json_shape import json_shape
from tools.sglang_cpu.server import SGLangServer

pytestmark = pytest.mark.sglang

START_TIMEOUT_S = 900.0


@pytest.fixture(scope="module")
def rm_dir(tiny_reward_model):
    return tiny_reward_model


@pytest.fixture(scope="module")
def sglang_rm(sglang_python, rm_dir, tmp_path_factory):
    server = SGLangServer(
        python=sglang_python, model=rm_dir, log=tmp_path_factory.getbasetemp() / "sglang_rm.log"
    )
    yield from healthy(server, START_TIMEOUT_S)


@pytest.fixture(scope="module")
def builtin_rm(rm_dir):
    from asyncrl.engine.api import EngineConfig
    from asyncrl.engine.server import serve

    srv = serve(EngineConfig(model=str(rm_dir)))
    yield srv
    srv.stop()


REQUESTS = [
    {"input_ids": [[5, 6, 7, 8, 9], [9, 10]]},
    {"input_ids": [40, 41, 42]},
    {"text": ["dcab=abcd", "x"]},
    {"text": "hello, world"},
]


@pytest.mark.parametrize("body", REQUESTS, ids=["ids-batch", "ids-one", "text-batch", "text-one"])
def test_builtin_classify_matches_real_sglang(sglang_rm, builtin_rm, rm_dir, body):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    real = httpx.post(f"{sglang_rm.url}/classify", json=body, timeout=120)
    ours = httpx.post(f"{builtin_rm.url}/classify", json=body, timeout=120)
    assert real.status_code == ours.status_code == 200
    real_items = real.json() if isinstance(real.json(), list) else [real.json()]
    our_items = ours.json() if isinstance(ours.json(), list) else [ours.json()]
    assert type(real.json()) is type(ours.json())
    # what asyncrl reads (embedding, meta_info.prompt_tokens) has the same shape; SGLang adds
    # timing fields of its own to meta_info
    for r, o in zip(real_items, our_items, strict=True):
        assert set(o) == set(r) == {"embedding", "meta_info"}
        assert set(o["meta_info"]) <= set(r["meta_info"])
        assert json_shape(o["embedding"]) == json_shape(r["embedding"])
        assert o["meta_info"]["prompt_tokens"] == r["meta_info"]["prompt_tokens"]
        assert o["embedding"][0] == pytest.approx(r["embedding"][0], abs=1e-4)
    tok = AutoTokenizer.from_pretrained(rm_dir)
    hf = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32)
    seqs = body.get("input_ids") or body["text"]
    seqs = seqs if isinstance(seqs[0], list | str) and not isinstance(seqs, str) else [seqs]
    for s, r in zip(seqs, real_items, strict=True):
        ids = tok(s)["input_ids"] if isinstance(s, str) else s
        with torch.no_grad():
            expected = float(hf(torch.tensor([ids])).logits[0, 0])
        assert r["embedding"][0] == pytest.approx(expected, abs=1e-4)


def test_model_reward_reads_real_sglang(sglang_rm, builtin_rm):
    """The rollout's model reward gets the same rewards from either server."""
    samples = [([5, 6], [7, 8, 9]), ([40], [41, 42, 43]), ([9], [10])]

    def rewards(url: str) -> list[float]:
        reward = build_reward(
            recipe_mod.from_dict({"rollout": {"reward": "model", "reward_model": {"urls": [url]}}})
        )
        out = [0.0] * len(samples)

        async def one(i: int) -> None:
            p, c = samples[i]
            r = await reward.score(
                prompt="", completion="", prompt_ids=p, completion_ids=c, row={}, extra={}
            )
            assert r.failure == ""
            out[i] = r.value

        async def main() -> None:
            async with trio.open_nursery() as n:
                for i in range(len(samples)):
                    n.start_soon(one, i)

        trio.run(main)
        return out

    assert rewards(sglang_rm.url) == pytest.approx(rewards(builtin_rm.url), abs=1e-4)
