"""`asyncrl learner` alone (one rank, in this process) fine-tunes a tiny random model on a synthetic
task until greedy decoding of its HF export gets most held-out prompts exactly right (none before)."""

from __future__ import annotations

import json

import pytest
import yaml

from asyncrl import recipe as recipe_mod
from asyncrl import tasks
from asyncrl.evaluate import evaluate_model
from asyncrl.metrics import read_metrics


@pytest.mark.slow
def test_sft_learns_reverse_on_held_out_prompts(tiny_qwen3, tmp_path):
    from asyncrl.learner.main import main

    train, held_out = tasks.write_task("reverse", tmp_path / "data", train=6400, eval=200)
    steps = 160
    recipe = tmp_path / "sft.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "run": {
                    "name": "sft",
                    "output_dir": str(tmp_path / "runs"),
                    "steps": steps,
                    "seed": 0,
                },
                "model": {"path": str(tiny_qwen3), "max_seq_len": 32},
                "data": {"path": str(train)},
                "algorithm": {"loss": "sft"},
                "learner": {"lr": 3e-3, "batch_size": 64, "checkpoint_every": 0},
                "logging": {"wandb": False},
            }
        )
    )
    assert main([str(recipe)]) == 0
    run = tmp_path / "runs" / "sft"
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert metrics[-1]["loss"] < 0.1 * metrics[0]["loss"]
    exported = run / "hf" / f"v{steps}"
    assert json.loads((exported / "config.json").read_text())["model_type"] == "qwen3"
    rows = tasks.read_jsonl(held_out)
    assert all(tasks.split_of(r["prompt"]) == "eval" for r in rows)
    # greedy, exact match ended by EOS (the recipe's reward), on a built-in engine
    held_out_recipe = recipe_mod.load(
        recipe, [f"data.eval_path={held_out}", "run.eval_prompts=200", "rollout.max_new_tokens=8"]
    )
    before = evaluate_model(held_out_recipe, tiny_qwen3).score
    after = evaluate_model(held_out_recipe, exported).score
    # 160 steps at lr 3e-3 amplify rounding: float32 AdamW implementations that differ by 5e-6
    # after 5 steps ended at 0.915 and 0.805 here; the claim is learning, with room for that
    assert before < 0.05 and after > 0.7, (before, after)
    assert (run / "checkpoints" / f"step-{steps}" / ".metadata").is_file()
