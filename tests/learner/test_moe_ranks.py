"""The tiny Qwen3-MoE on two ranks (torchrun, gloo, FSDP2 through TorchTitan's MoE blocks) with
routing replay on: the log-probabilities before the step, the step's loss, gradient norm and
routing agreement, the weights after it and a weight broadcast's rank-0 gather (the per-expert
split of the sharded expert tensors under HF names) equal one rank's on the same global batch.

The batch's samples carry routes that are not the learner's own choice (random expert pairs), so
a rank that dropped or misaligned them (the routes are split over ranks with their sequences, and
packed per micro-batch) would give other log-probabilities, not rounding apart."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from asyncrl import wire
from asyncrl.learner.source import Batch, encode_batch
from tests.learner.step_on_batch import random_sample, run_ranks
from tests.numerics import assert_adam_steps_agree, assert_close_rel, assert_logits_close, hf_grads

EXPERTS, TOP_K, MOE_LAYERS = 8, 2, 2  # the tiny_qwen3_moe fixture's (tools/make_tiny_model.py)


def routed(i: int, n: int) -> wire.Sample:
    """:func:`random_sample` ``i`` with ``n`` completion tokens (trained), and routes: for each of
    its input positions and MoE layers two distinct experts drawn from seed ``100 + i``."""
    s = random_sample(i, n, True)
    rng = np.random.default_rng(100 + i)
    positions = len(s.prompt_ids) + n - 1
    keys = rng.random((positions, MOE_LAYERS, EXPERTS))
    s.routed_experts = np.argsort(keys, -1)[..., :TOP_K].astype(np.uint8)
    return s


@pytest.mark.numerics
@pytest.mark.slow
def test_two_ranks_with_routing_replay_match_one_rank(tiny_qwen3_moe, tmp_path):
    from asyncrl import recipe as recipe_mod
    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.trainer import Trainer

    # 6 samples of uneven lengths: each rank gets a share, in several micro-batches
    samples = [routed(i, n) for i, n in enumerate((20, 7, 31, 12, 16, 9))]
    batch = Batch(groups=[wire.Group(id="g", samples=samples)], version=0, stats={})
    spec = {
        "run": {"output_dir": str(tmp_path / "runs")},
        "model": {"path": str(tiny_qwen3_moe), "max_seq_len": 64},
        "algorithm": {"loss": "ppo", "routing_replay": True},
        "learner": {"lr": 1e-3, "micro_batch_tokens": 40},
        "buffer": {"max_staleness": 2},
        "logging": {"wandb": False},
    }
    recipe_file = tmp_path / "rl.yaml"
    recipe_file.write_text(yaml.safe_dump(spec))
    (tmp_path / "batch.bin").write_bytes(encode_batch(batch))
    proc = run_ranks(recipe_file, tmp_path / "batch.bin", tmp_path, "--before", "--export")
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((tmp_path / "metrics.json").read_text())

    tr = Trainer(
        TrainerConfig.from_recipe(recipe_mod.load(recipe_file)),
        run_dir=tmp_path / "one",
        checkpointing=False,
    )
    assert tr.models.config.algorithm.routing_replay
    # before the step: every trained token's log π, replayed through the recorded experts
    seqs = tr.sequences(batch)
    logp = torch.cat(tr.logprobs(tr.micro_batches(seqs)))
    assert_logits_close(logp, load_file(str(tmp_path / "logprobs.safetensors"))["logp"])
    # a broadcast's gather under FSDP: every expert under its HF name, bitwise one rank's weights
    before = tr.hf_state_dict()
    sent = load_file(str(tmp_path / "sent.safetensors"))
    assert set(sent) == set(before)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in sent
    for k, v in before.items():
        assert torch.equal(sent[k], v.to(torch.bfloat16)), k
    saved = load_file(str(tmp_path / "before.safetensors"))
    assert set(saved) == set(before) and all(torch.equal(before[k], v) for k, v in saved.items())

    one = tr.step(batch)
    trained = sum(len(s.completion_ids) for s in samples)
    assert one.metrics["loss/tokens"] == two["loss/tokens"] == trained
    assert_close_rel(one.loss, two["loss"])
    assert_close_rel(one.metrics["grad_norm"], two["grad_norm"])
    # routing agreement: the learner's own top-k vs the routes, counted over both ranks' forwards.
    # The routes are random, so the learner's own pair matches about 1 in 28 of them; the count
    # is of discrete choices, equal unless a near tie between two experts' scores (|Δ| at float32
    # rounding) falls the other way under the other rank's packing: allow one such flip per pass.
    # One flip moves the fraction by 1 / (positions x MoE layers) per forward that counted it.
    agree = one.metrics["learner/routing_agreement"]
    assert 0 < agree < 0.2
    positions = sum(len(s.prompt_ids) + len(s.completion_ids) - 1 for s in samples)
    assert abs(agree - two["learner/routing_agreement"]) <= 1 / (positions * MOE_LAYERS)
    after = load_file(str(tmp_path / "weights.safetensors"))
    assert_adam_steps_agree(tr.hf_state_dict(), after, hf_grads(tr), lr=one.metrics["lr"])
    # the HF export (DCP's HF writer: each rank writes its own experts) holds the same weights
    (shard,) = (tmp_path / "export").glob("*.safetensors")
    exported = load_file(str(shard))
    assert set(exported) == set(after)
    assert all(torch.equal(exported[k], v) for k, v in after.items())
