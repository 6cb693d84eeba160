"""Tensor parallelism in the learner (``placement.<role>.tensor_parallel``): two gloo ranks forming
one tensor-parallel group (and four: two data-parallel ranks of two), TorchTitan's plan for Qwen3
and Llama, against one rank without it on the same batch: the same log π, the same weights before
and after one optimizer step, the same tensors for a weight broadcast and in an HF export; the
critic as well."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from asyncrl import metric_names, wire
from asyncrl import recipe as recipe_mod
from asyncrl.learner.source import Batch, encode_batch
from asyncrl.recipe import RecipeError
from tests.learner.step_on_batch import random_sample, run_ranks
from tests.numerics import (
    assert_adam_steps_agree,
    assert_close_rel,
    assert_grads_close,
    assert_logits_close,
    hf_grads,
)

pytestmark = pytest.mark.numerics  # compares float32 results across kernels (tests/numerics.py)


def _batch() -> Batch:
    """Four samples of one group, uneven lengths, one with no trained token."""
    lengths = [(30, True), (6, False), (17, True), (11, True)]
    samples = [random_sample(i, n, trained) for i, (n, trained) in enumerate(lengths)]
    return Batch(groups=[wire.Group(id="g", samples=samples)], version=0, stats={})


def _recipes(
    tmp_path: Path, model: Path, alg: dict, chunk_mb: float, tp: dict
) -> tuple[Path, Path]:
    """The recipe with ``tp`` (role → tensor-parallel degree) and the same one without TP."""
    spec = {
        "run": {"output_dir": str(tmp_path / "runs")},
        "model": {"path": str(model), "max_seq_len": 64},
        "algorithm": alg,
        "learner": {"lr": 1e-3, "micro_batch_tokens": 40, "logits_chunk_mb": chunk_mb},
        "buffer": {"max_staleness": 2},
        "logging": {"wandb": False},
    }
    one = tmp_path / "tp1.yaml"
    one.write_text(yaml.safe_dump(spec))
    two = tmp_path / "tp2.yaml"
    spec["placement"] = {role: {"tensor_parallel": d} for role, d in tp.items()}
    two.write_text(yaml.safe_dump(spec))
    return one, two


KL_LOSS = {"loss": "ppo", "kl_coef": 0.1, "entropy_coef": 0.01}
CRITIC = {"loss": "ppo", "advantage": "gae", "kl_reward_coef": 0.1}


@pytest.mark.parametrize(
    ("fixture", "chunk_mb", "alg", "tp", "ranks"),
    [
        # tied embeddings, one chunk; π_ref without TP beside the actor with it
        ("tiny_qwen3", 256.0, KL_LOSS, {"actor": 2}, 2),
        # untied, chunks of 13 tokens (6 at TP=1), the output projection in its own FSDP group; π_ref with TP
        ("tiny_llama", 0.01, KL_LOSS, {"actor": 2, "ref": 2}, 2),
        # a critic (its one-output head replicated over the group) and a KL reward
        ("tiny_qwen3", 256.0, CRITIC, {"actor": 2, "critic": 2, "ref": 2}, 2),
        # two data-parallel ranks of two tensor-parallel ones: the batch split in two, FSDP × TP
        ("tiny_llama", 0.01, KL_LOSS, {"actor": 2, "ref": 2}, 4),
    ],
    ids=["qwen3-tied", "llama-untied-chunks", "qwen3-critic", "llama-dp2-tp2"],
)
@pytest.mark.slow
def test_tensor_parallel_step_equals_one_rank(fixture, chunk_mb, alg, tp, ranks, request, tmp_path):
    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.trainer import Trainer

    one_file, two_file = _recipes(tmp_path, request.getfixturevalue(fixture), alg, chunk_mb, tp)
    batch = _batch()
    (tmp_path / "batch.bin").write_bytes(encode_batch(batch))
    flags = ("--before", "--grads", "--export")
    proc = run_ranks(two_file, tmp_path / "batch.bin", tmp_path, *flags, ranks=ranks)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((tmp_path / "metrics.json").read_text())

    tr = Trainer(
        TrainerConfig.from_recipe(recipe_mod.load(one_file)),
        run_dir=tmp_path / "one",
        checkpointing=False,
    )
    try:
        seqs = tr.sequences(batch)
        lp_one = torch.cat(tr.logprobs(tr.micro_batches(seqs)))
        before = tr.hf_state_dict()
        sent = tr.hf_state_dict(torch.bfloat16)
        one = tr.step(batch)
        after = tr.hf_state_dict()
        grads = hf_grads(tr)
    finally:
        tr.close()

    # log π before the step: the vocabulary-parallel projection against the whole one
    lp_two = load_file(str(tmp_path / "logprobs.safetensors"))["logp"]
    assert lp_two.shape == lp_one.shape == (58,)
    assert_logits_close(lp_two, lp_one)
    # the TP-sharded weights gather (FSDP and TP) to exactly what was loaded
    gathered = load_file(str(tmp_path / "before.safetensors"))
    assert set(gathered) == set(before)
    assert all(torch.equal(gathered[k], before[k]) for k in before)
    # what a bfloat16 weight broadcast sends (rank 0's gather), bitwise TP=1's
    sent_two = load_file(str(tmp_path / "sent.safetensors"))
    assert set(sent_two) == set(sent)
    assert all(torch.equal(sent_two[k], sent[k]) for k in sent)

    # one step: every rank of the group trained on the same tokens, counted once
    assert one.metrics["loss/tokens"] == two["loss/tokens"] == 58
    assert_close_rel(one.loss, two["loss"], scale=1.0)  # with a critic: whitened advantages
    assert_close_rel(one.metrics["grad_norm"], two["grad_norm"])
    if alg is CRITIC:
        for k in (metric_names.VALUE_LOSS, "critic/grad_norm", metric_names.EXPLAINED_VARIANCE):
            assert_close_rel(one.metrics[k], two[k])
    assert_grads_close(grads, load_file(str(tmp_path / "grads.safetensors")))
    weights = load_file(str(tmp_path / "weights.safetensors"))
    assert set(weights) == set(after)
    # One AdamW step from bitwise-equal weights, the gradients summed in another order: each entry
    # within the bound its own gradient implies (tests/numerics.py), never one absolute bound.
    # Where |g| is a few Adam ε (4.9e-8 on tiny_llama, 1e-4 of its tensor's largest |g|), the
    # update lr·g/(|g|+ε) moves by lr·ε/(|g|+ε)² ≈ 2.8e3 per unit of Δg: the Δg that
    # assert_grads_close allows there (4.7e-9) moves the weight 1.4e-5.
    assert_adam_steps_agree(after, weights, grads, lr=one.metrics["lr"])

    # a broadcast's gather: rank 0 alone keeps every tensor, in the wire dtype
    kept = [json.loads((tmp_path / f"kept-rank{r}.json").read_text()) for r in range(ranks)]
    assert kept[0] == {"tensors": len(after), "dtypes": ["torch.bfloat16"]}
    assert kept[1:] == [{"tensors": 0, "dtypes": []}] * (ranks - 1)
    # the HF export (DCP's writer over the TP and FSDP shards) holds the gathered weights
    exported = load_file(str(tmp_path / "export" / "model-00001-of-00001.safetensors"))
    assert set(exported) == set(weights)
    assert all(torch.equal(exported[k], weights[k]) for k in weights)


def test_a_critic_with_another_tensor_parallel_degree_is_refused(tiny_qwen3, tmp_path):
    """The critic trains on the actor's micro-batches: on the same ranks it needs the actor's data
    split, so the same tensor-parallel degree. The recipe's own checks say so (what `asyncrl check`
    runs), naming the field; without a critic the field is not used and not refused."""
    recipe = {
        "run": {"output_dir": str(tmp_path / "runs")},
        "model": {"path": str(tiny_qwen3), "max_seq_len": 64},
        "algorithm": CRITIC,
        "placement": {"critic": {"tensor_parallel": 2}},
        "logging": {"wandb": False},
    }
    with pytest.raises(RecipeError, match=r"placement.critic.tensor_parallel: 2 differs"):
        recipe_mod.from_dict(recipe)
    recipe["placement"] = {
        "critic": {"tensor_parallel": 2, "ranks": [1, 2]},
        "actor": {"ranks": [0]},
    }
    recipe_mod.from_dict(recipe)  # on other ranks the critic splits its data its own way
    recipe["placement"] = {"critic": {"tensor_parallel": 2}}
    recipe["algorithm"] = {"loss": "sft"}
    recipe_mod.from_dict(recipe)


def test_a_degree_the_ranks_do_not_split_into_is_refused(tiny_qwen3, tmp_path):
    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.trainer import LearnerError, Trainer

    r = recipe_mod.from_dict(
        {
            "run": {"output_dir": str(tmp_path / "runs")},
            "model": {"path": str(tiny_qwen3), "max_seq_len": 64},
            "algorithm": {"loss": "sft"},
            "placement": {"actor": {"tensor_parallel": 2}},
            "logging": {"wandb": False},
        }
    )
    with pytest.raises(LearnerError, match=r"1 rank\(s\) do not split into tensor-parallel"):
        Trainer(TrainerConfig.from_recipe(r), run_dir=tmp_path / "run", checkpointing=False)
