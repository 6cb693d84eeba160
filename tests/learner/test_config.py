"""The learner's config: what its machinery reads of the recipe, gathered by one function."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from asyncrl import recipe as recipe_mod
from asyncrl.learner.config import BuildConfig, HeldOutPairs, TrainerConfig
from asyncrl.recipe import LoraConfig

# every value differs from the recipe's default, so a field read from the wrong place (or left at
# a default) differs from what the recipe says
SPEC = {
    "run": {
        "name": "cfg",
        "seed": 7,
        "steps": 11,
        "resume": True,
        "eval_every": 3,
        "eval_prompts": 5,
    },
    "model": {"path": "m", "dtype": "bfloat16", "attention": "sdpa", "max_seq_len": 99},
    "data": {"eval_path": "pairs.jsonl", "chosen_key": "good", "chat_template": True},
    "rollout": {
        "temperature": 0.7,
        "max_new_tokens": 33,
        "turn_samples": True,
        "turn_discount": 0.9,
    },
    "buffer": {"max_staleness": 3, "overlong_filter": True, "batch_timeout_s": 100},
    "weights": {"timeout_s": 5},
    "algorithm": {"advantage": "gae", "loss": "ppo", "kl_coef": 0.05, "value_clip": 0.3},
    "learner": {
        "lr": 2e-4,
        "grad_clip": 0.5,
        "minibatches": 2,
        "epochs": 3,
        "micro_batch_tokens": 77,
        "logits_chunk_mb": 9.0,
        "compile": True,
        "activation_checkpointing": "full",
        "betas": [0.8, 0.95],
        "eps": 1e-7,
        "weight_decay": 0.1,
        "warmup_steps": 2,
        "lr_schedule": "cosine",
        "checkpoint_every": 4,
        "checkpoint_async": False,
        "keep_checkpoints": 5,
        "export_every": 6,
        "lora": {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "down_proj"]},
    },
    "critic": {"path": "v", "lr": 3e-3},
    "placement": {"ref": {"offload": True}},
}


def test_from_recipe_carries_what_a_step_with_a_critic_and_a_reference_reads(tmp_path):
    r = recipe_mod.from_dict(
        SPEC | {"run": SPEC["run"] | {"output_dir": str(tmp_path)}}, check_files=False
    )
    r.base_dir = str(tmp_path / "recipes")
    c = TrainerConfig.from_recipe(r)
    base = tmp_path / "recipes"
    expected = {
        "model_dir": base / "m",
        "critic_dir": base / "v",
        "run_dir": tmp_path / "cfg",
        "resume": True,
        "seed": 7,
        "steps": 11,
        "collective_timeout_s": 100 + 10 * 5 + 600.0,
        "attention": "sdpa",
        "max_seq_len": 99,
        "flow": c.flow,  # checked below by its calls
        "roles": ("actor", "critic", "ref"),
        "placement": r.placement,
        "algorithm": r.algorithm,
        "temperature": 0.7,
        "learner": r.learner,  # the recipe's section, read where it is (checked below)
        "critic": r.critic,
        "max_staleness": 3,
        "overlong_filter": True,
        "max_new_tokens": 33,
        "turn_discount": 0.9,
        "build": BuildConfig(learner=r.learner, dtype="bfloat16", versions=11, seed=7),
        "held_out": HeldOutPairs(path=base / "pairs.jsonl", limit=5, every=3, data=r.data),
    }
    assert {f.name for f in dataclasses.fields(c)} == set(expected)  # a new field is tested here
    for name, value in expected.items():
        assert getattr(c, name) == value, name
    calls = {call.name for call in c.flow.calls}
    assert {"prox", "ref", "values", "advantages", "train_actor", "train_critic"} <= calls
    assert c.algorithm.value_clip == 0.3 and c.algorithm.kl_coef == 0.05
    assert c.placement.ref.offload and c.held_out.data.chosen_key == "good"
    lc = c.learner
    assert (lc.lr, c.critic.lr, lc.grad_clip, lc.epochs, lc.minibatches) == (2e-4, 3e-3, 0.5, 3, 2)
    assert (lc.micro_batch_tokens, lc.logits_chunk_mb, lc.compile) == (77, 9.0, True)
    assert (lc.activation_checkpointing, lc.betas, lc.eps, lc.weight_decay) == (
        "full",
        [0.8, 0.95],
        1e-7,
        0.1,
    )
    assert (lc.warmup_steps, lc.lr_schedule, c.build.updates_per_version) == (2, "cosine", 6)
    assert lc.lora == LoraConfig(rank=4, alpha=8.0, targets=["q_proj", "down_proj"])
    assert (lc.checkpoint_every, lc.checkpoint_async, lc.keep_checkpoints) == (4, False, 5)
    assert lc.export_every == 6 and c.build.learner is lc


def test_sft_takes_log_pi_at_temperature_1_and_no_held_out_pairs_without_a_file(tmp_path):
    """An SFT row's log π is the model's own (T = 1), whatever rollout.temperature says."""
    c = TrainerConfig.from_recipe(
        recipe_mod.from_dict(
            {"algorithm": {"loss": "sft"}, "rollout": {"temperature": 0.5}}, check_files=False
        )
    )
    assert c.temperature == 1.0 and c.roles == ("actor",)
    assert c.held_out.path is None
    assert c.critic_dir == c.model_dir == Path(".")  # critic.path defaults to model.path
