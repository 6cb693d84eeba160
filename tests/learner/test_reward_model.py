"""``algorithm.loss: reward_model``: Bradley–Terry on preference pairs with the scalar-head model,
its HF sequence-classification export (transformers scores it as the learner does), and a run
through `asyncrl learner` that learns held-out pairs, checkpoints and resumes."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
import yaml

from asyncrl import recipe as recipe_mod
from asyncrl import tasks
from asyncrl.learner.reward_model import pair_bins
from asyncrl.metrics import read_metrics


def test_pair_bins_first_fit_decreasing():
    assert pair_bins([5, 3, 4, 10], 8) == [[3], [0, 1], [2]]
    assert sorted(i for b in pair_bins([1] * 7, 3) for i in b) == list(range(7))


def rm_recipe(tmp_path, model, steps: int, **learner) -> dict:
    tasks.write_preferences("sort", tmp_path, train=2000, eval=100, seed=1)
    return {
        "run": {"name": "rm", "output_dir": str(tmp_path / "runs"), "steps": steps},
        "model": {"path": str(model), "max_seq_len": 32},
        "data": {"path": str(tmp_path / "train.jsonl"), "eval_path": str(tmp_path / "eval.jsonl")},
        "algorithm": {"loss": "reward_model"},
        "learner": {"lr": 2e-3, "batch_size": 32, "checkpoint_every": 0} | learner,
        "logging": {"wandb": False},
    }


@pytest.mark.parametrize(
    ("fixture", "arch"),
    [
        ("tiny_qwen3", "Qwen3ForSequenceClassification"),
        ("tiny_llama", "LlamaForSequenceClassification"),
    ],
)
def test_scalar_model_export_scores_like_transformers(fixture, arch, request, tmp_path):
    """The export is a *ForSequenceClassification folder: transformers' scores equal the learner's
    (≤ 1e-5), and a learner started from the export has the same head. Qwen3 (tied embeddings:
    untied here) and Llama (q/k permuted by TorchTitan's adapter)."""
    tiny_qwen3 = request.getfixturevalue(fixture)
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.trainer import Trainer

    r = recipe_mod.from_dict(rm_recipe(tmp_path, tiny_qwen3, 1))
    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    seqs = [np.asarray(tok(t)["input_ids"]) for t in ("dcab=abcd<eos>", "x", "hello, world")]
    trainer = Trainer(TrainerConfig.from_recipe(r), checkpointing=False)
    with torch.no_grad():
        ours = trainer.reward_model.scores(seqs)
    out = trainer.export_hf(tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [arch] and cfg["num_labels"] == 1
    tensors = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert tensors["score.bias"].tolist() == [0.0]  # for SGLang (scalar_model.HF_BIAS)
    hf = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = torch.stack([hf(torch.as_tensor(s)[None]).logits[0, 0] for s in seqs])
    assert torch.allclose(ours, theirs, atol=1e-5), (ours, theirs)
    again = Trainer(
        TrainerConfig.from_recipe(recipe_mod.from_dict(rm_recipe(tmp_path, out, 1))),
        checkpointing=False,
    )
    with torch.no_grad():
        assert torch.allclose(again.reward_model.scores(seqs), ours, atol=1e-6)


def test_reward_model_run_learns_held_out_pairs_and_resumes(tiny_qwen3, tmp_path):
    from asyncrl.learner.main import main

    recipe = tmp_path / "rm.yaml"
    recipe.write_text(yaml.safe_dump(rm_recipe(tmp_path, tiny_qwen3, 40, checkpoint_every=20)))
    assert main([str(recipe), "run.steps=20"]) == 0
    assert main([str(recipe), "run.resume=true"]) == 0
    run = tmp_path / "runs" / "rm"
    metrics = [m for m in read_metrics(run) if "rm/loss" in m]
    assert [m["step"] for m in metrics] == list(range(1, 41))
    assert np.mean([m["rm/accuracy"] for m in metrics[-5:]]) >= 0.85, metrics[-5:]
    assert metrics[-1]["rm/loss"] < 0.5 * metrics[0]["rm/loss"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["algorithm"] == "reward_model"
    assert summary["rm_eval_accuracy"] >= 0.9, summary
    cfg = json.loads((run / "hf" / "v40" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForSequenceClassification"]


def test_bad_preference_row_names_file_and_row(tiny_qwen3, tmp_path, capsys):
    from asyncrl.learner.main import main

    d = rm_recipe(tmp_path, tiny_qwen3, 1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": "b"}\n'
    )
    d["data"]["path"] = str(bad)
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(yaml.safe_dump(d))
    assert main([str(recipe)]) == 2
    assert f"{bad}: row 2 has no 'rejected' field" in capsys.readouterr().err


def test_micro_batches_leave_no_unsharded_gradient_to_the_next(tiny_qwen3, tmp_path):
    """The reward model's gradient accumulation reduce-scatters at every micro-batch, as the
    actor's (tests/learner/test_critic.py): no forward starts with an unsharded gradient held."""
    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.dataset_sources import PreferenceSource
    from asyncrl.learner.trainer import Trainer
    from tools.bench.accumulation_memory import held_at_each_forward

    recipe = recipe_mod.from_dict(rm_recipe(tmp_path, tiny_qwen3, 1, micro_batch_tokens=100))
    trainer = Trainer(TrainerConfig.from_recipe(recipe), checkpointing=False)
    try:
        with held_at_each_forward([trainer.models.actor]) as held:
            res = trainer.step(PreferenceSource.from_recipe(recipe).next_batch())
    finally:
        trainer.close()
    assert len(held) == res.metrics["learner/micro_batches"] > 1
    assert held == [0] * len(held)


def test_preferences_prefer_the_right_answer():
    rows = tasks.preferences("addition", split="eval", n=200, seed=0)
    assert all(r["chosen"] != r["rejected"] for r in rows)
    assert all(int(r["prompt"][:2]) + int(r["prompt"][3:5]) == int(r["chosen"]) for r in rows)
    assert tasks.preferences("sort", split="train", n=5) == tasks.preferences(
        "sort", split="train", n=5
    )
    assert tasks.wrong_answer(random.Random(0), "aa") != "aa"


@pytest.mark.numerics
@pytest.mark.parametrize("tp", [1, 2], ids=["fsdp", "tensor-parallel"])
@pytest.mark.slow
def test_two_ranks_match_one_rank(tp, tiny_qwen3, tmp_path):
    """Under torchrun (2 ranks, gloo, FSDP2, several micro-batches each; or one tensor-parallel
    group of two, the head replicated over it): each step's losses, gradient norms and accuracy,
    and the held-out accuracy, are one rank's on the same weights and batch, and the first step's
    weights are one rank's up to Adam's rounding.

    One Adam step moves an entry whose gradient is within rounding of 0 up to 2·lr apart
    (tests/numerics.py), and what the next step reports moves with it: the 97 such entries of one
    rank's step 1 moved by that bound (random signs) moved its step-2 gradient norm by 1.5-2.2e-4,
    relative, and the held-out accuracy by a pair in one draw of two. So one rank takes step 2 from
    the two-rank run's export of version 1 and counts held-out pairs with version 2's: what a step
    reports is computed before its update, from the weights alone."""
    from safetensors.torch import load_file

    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.dataset_sources import PreferenceSource
    from asyncrl.learner.trainer import Trainer
    from tests.learner.test_distributed import finish, torchrun
    from tests.numerics import assert_adam_steps_agree, assert_close_rel, hf_grads

    recipe = tmp_path / "rm.yaml"
    spec = rm_recipe(tmp_path, tiny_qwen3, 2, micro_batch_tokens=100, export_every=1)
    recipe.write_text(yaml.safe_dump(spec))
    rc, err = finish(torchrun(recipe, f"placement.actor.tensor_parallel={tp}"))
    assert rc == 0, err[-3000:]
    run = tmp_path / "runs" / "rm"
    two = {m["step"]: m for m in read_metrics(run) if "rm/loss" in m}

    def one_rank(model, name: str) -> Trainer:
        over = ["learner.micro_batch_tokens=100000", f"model.path={model}"]
        return Trainer(
            TrainerConfig.from_recipe(recipe_mod.load(recipe, over)),
            run_dir=tmp_path / name,
            checkpointing=False,
        )

    src = PreferenceSource.from_recipe(recipe_mod.load(recipe))
    for step, start in ((1, tiny_qwen3), (2, run / "hf" / "v1")):
        trainer = one_rank(start, f"one-{step}")
        try:
            one = trainer.step(src.next_batch()).metrics
            assert one["learner/micro_batches"] == 1 and two[step]["learner/micro_batches"] > 1
            assert_close_rel(one["rm/loss"], two[step]["rm/loss"])
            assert_close_rel(one["grad_norm"], two[step]["grad_norm"])
            # a mean of score differences (|s| < 1) that cancel: it rounds at the scores' scale
            assert_close_rel(one["rm/margin"], two[step]["rm/margin"], scale=1.0)
            assert one["rm/accuracy"] == two[step]["rm/accuracy"]
            if step == 1:  # one Adam step from the same weights: entry by entry
                files = (run / "hf" / "v1").glob("*.safetensors")
                exported = {k: v for f in files for k, v in load_file(f).items()}
                mine = trainer.hf_state_dict()
                assert set(mine) == set(exported)
                assert_adam_steps_agree(mine, exported, hf_grads(trainer), lr=one["lr"])
        finally:
            trainer.close()
    final = one_rank(run / "hf" / "v2", "one-final")
    try:
        assert final.reward_model.held_out_accuracy() == two[2]["rm/eval_accuracy"]
    finally:
        final.close()
