"""Routes a sample brings to the learner (issue #55's replay): those that cannot be replayed on
its model are refused in one line naming the sample, before any kernel sees them (on CUDA an
expert id out of range is a device-side assert, which ends the process; one expert twice in a
top-k breaks TorchTitan's token dispatch), and the rollout's own padding replays."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.learner.models import LearnerError
from asyncrl.moe import fit_routes
from tests.learner.test_model import make_trainer
from tests.learner.test_step import rl_batch

EXPERTS, MOE_LAYERS, TOP_K = 8, 2, 2


def routed(batch, rng: np.random.Generator, *, short: int = 0):
    """Every sample with a router's routes: ``TOP_K`` distinct experts per position and MoE
    layer; ``short`` positions fewer, padded by the rollout's :func:`fit_routes`."""
    for g in batch.groups:
        for s in g.samples:
            rows = len(s.prompt_ids) + len(s.completion_ids) - 1
            r = np.argsort(rng.random((rows - short, MOE_LAYERS, EXPERTS)), -1)[..., :TOP_K]
            s.routed_experts = fit_routes(r.astype(np.uint8), rows)
    return batch


def test_routes_padded_past_the_last_turn_replay(tiny_qwen3_moe, tmp_path):
    """Tool output after an episode's last generated token was never routed: the rollout pads
    its positions, and the learner replays the sample (the padding was expert 0 k times, which
    failed every step under replay)."""
    tr = make_trainer(tiny_qwen3_moe, tmp_path, algorithm={"routing_replay": True})
    batch = routed(rl_batch(tr.models.spec.model.vocab_size), np.random.default_rng(0), short=2)
    res = tr.step(batch)
    assert np.isfinite(res.loss) and "learner/routing_agreement" in res.metrics


def test_routes_that_do_not_fit_the_model_are_refused_in_one_line(
    tiny_qwen3_moe, tiny_qwen3, tmp_path
):
    tr = make_trainer(tiny_qwen3_moe, tmp_path, algorithm={"routing_replay": True})
    vocab = tr.models.spec.model.vocab_size

    def twice(r):
        r[3, 1] = [5, 5]

    def out_of_range(r):
        r[0, 0, 1] = EXPERTS

    cases = [
        (twice, r"sample '1-2': routed_experts position 3, MoE layer 1: expert 5 twice"),
        (out_of_range, r"sample '1-2': routed_experts expert id 8 outside \[0, 8\)"),
    ]
    for spoil, match in cases:
        batch = routed(rl_batch(vocab), np.random.default_rng(1))
        s = batch.groups[1].samples[2]
        s.routed_experts = s.routed_experts.copy()
        spoil(s.routed_experts)
        with pytest.raises(LearnerError, match=match) as e:
            tr.step(batch)
        assert "\n" not in str(e.value)
    batch = routed(rl_batch(vocab), np.random.default_rng(2))
    s = batch.groups[0].samples[0]
    s.routed_experts = np.concatenate([s.routed_experts] * 2, axis=1)  # 4 MoE layers' rows
    with pytest.raises(LearnerError, match=r"\[moe_layers, top_k\] \[4, 2\], but .* \[2, 2\]"):
        tr.step(batch)
    assert tr.version == 0  # nothing was trained on
    dense = make_trainer(tiny_qwen3, tmp_path / "dense", algorithm={"routing_replay": False})
    batch = routed(rl_batch(dense.models.spec.model.vocab_size), np.random.default_rng(3))
    with pytest.raises(LearnerError, match="the model is dense"):
        dense.step(batch)
