"""A weight update reaches the engine's fused q/k/v and gate/up projections without a copy: the
fused tensors the engine serves after the swap are the very buffers the broadcasts were received
into, and its logits equal a fresh model's with the same weights. Rank 0 is another process
(rank0_peer.py), the engine is served from this one, so that its tensors can be looked at."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.engine import EngineConfig, serve
from asyncrl.weights import buckets
from tests.engine_streams import PostInThread
from tests.numerics import assert_logits_close

pytestmark = pytest.mark.numerics  # compares float32 logits with transformers' (tests/numerics.py)

GROUP = "fused_update_group"
PEER = Path(__file__).with_name("rank0_peer.py")
PROMPT = [5, 6, 7, 8, 9, 10]


def perturbed(path: Path, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Every parameter of the model at ``path`` plus seeded noise: new weights to send."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    return [
        (n, p.detach() + 0.05 * torch.randn(p.shape, generator=g))
        for n, p in model.named_parameters()
    ]


def _reference_logits(path: Path, named: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.load_state_dict(dict(named), strict=False)
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0]


@torch.no_grad()
def test_a_distributed_update_is_adopted_without_a_copy(tiny_qwen3, tmp_path):
    peer = subprocess.Popen(
        [sys.executable, str(PEER), GROUP], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    line = peer.stdout.readline()  # the peer listens on the port it reports
    assert line.startswith("port "), line
    port = int(line.split()[1])
    with (
        serve(EngineConfig(model=str(tiny_qwen3))) as srv,
        httpx.Client(base_url=srv.url, timeout=120) as client,
    ):
        eng = srv.engine
        lm, store = eng.scheduler.lm, eng.store
        init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1}
        init |= {"world_size": 2, "group_name": GROUP, "backend": "gloo"}
        r = PostInThread(client, "/init_weights_update_group", init).join()
        assert r.status_code == 200, r.text

        def served_logits() -> torch.Tensor:
            return eng.call(lambda: lm.prefill(lm.new_cache(), 0, [PROMPT], all_logits=True))[1][0]

        def update(named, load_format: str) -> dict[str, torch.Tensor]:
            """Send ``named`` in one update call; what the session staged (received) for it."""
            path = tmp_path / f"{load_format}.pt"
            torch.save(named, path)
            b = buckets.Bucket(names=[n for n, _ in named], tensors=[t for _, t in named])
            body = {**b.meta(), "group_name": GROUP}
            if load_format == "flattened_bucket":  # else SGLang's default: one broadcast each
                body["load_format"] = load_format
            call = PostInThread(client, "/update_weights_from_distributed", body)
            peer.stdin.write(f"{load_format} {path}\n")
            peer.stdin.flush()
            r = call.join()
            assert r.status_code == 200, r.text
            return dict(store._staged)  # the session's received tensors, before the swap

        def assert_adopted(staged: dict[str, torch.Tensor]) -> None:
            """The served parameters and fused tensors are where the broadcasts landed."""
            params = dict(eng.hf_model.named_parameters())
            assert {n: params[n].data_ptr() for n in staged} == {
                n: t.data_ptr() for n, t in staged.items()
            }
            received = {t.data_ptr() for t in staged.values()}
            assert all(f.weight.data_ptr() in received for f in lm.fused.values())

        try:
            for load_format, seed in (("list", 1), ("flattened_bucket", 2)):
                new = perturbed(tiny_qwen3, seed)
                before = served_logits()
                assert client.post("/begin_weight_update", json={}).json()["success"]
                staged = update(new, load_format)
                # new buffers each session: what the engine serves until the swap is untouched
                assert torch.equal(served_logits(), before)
                assert client.post("/end_weight_update", json={}).json()["success"]
                assert_adopted(staged)
                assert_logits_close(served_logits(), _reference_logits(tiny_qwen3, new))

            # a group only partly updated is fused by a copy of its members, and still served right
            name = "model.layers.1.self_attn.k_proj.weight"
            one = [(name, dict(new)[name] + 0.1)]
            assert client.post("/begin_weight_update", json={}).json()["success"]
            update(one, "list")
            assert client.post("/end_weight_update", json={}).json()["success"]
            assert_logits_close(served_logits(), _reference_logits(tiny_qwen3, new + one))
            client.post("/destroy_weights_update_group", json={"group_name": GROUP})
            peer.stdin.close()
            assert peer.wait(60) == 0
        finally:
            peer.kill()  # when a failure left it in a broadcast; a no-op after it exited
