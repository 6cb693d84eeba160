"""The shipped recipes are valid: GPU ones with --no-files here, the demo ones on the built demo."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from asyncrl import check, recipe
from tools.make_demo import make_demo

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def test_there_are_demo_and_gpu_recipes():
    names = {p.name for p in RECIPES}
    assert {"demo.yaml", "demo_sft.yaml", "qwen3_0.6b_gsm8k.yaml", "multinode.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_leaves_the_attention_to_auto_or_says_why(path):
    """An explicit attention refuses to start where its kernels are missing (varlen needs FA3 on an
    H100, which neither the gpu extra nor the docs install): auto picks what imports."""
    model = yaml.safe_load(path.read_text()).get("model") or {}
    kind = model.get("attention", "auto")
    if kind == "auto":
        return
    lines = [x for x in path.read_text().splitlines() if x.strip().startswith("attention:")]
    assert lines and all("#" in x for x in lines), (
        f"{path.name}: model.attention {kind} without a comment saying why not auto"
    )


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_passes_check_without_files(path, capsys):
    assert check.main(["--no-files", str(path)]) == 0
    assert "file existence not checked" in capsys.readouterr().err


def test_gpu_recipe_with_file_checks_names_the_missing_model(capsys):
    assert check.main([str(ROOT / "recipes/qwen3_0.6b_gsm8k.yaml")]) == 2
    err = capsys.readouterr().err
    assert "model.path" in err and "/models/Qwen3-0.6B" in err and "Traceback" not in err


def test_no_files_still_checks_the_schema(capsys):
    path = str(ROOT / "recipes/multinode.yaml")
    assert check.main(["--no-files", path, "buffer.max_staleness=-1"]) == 2
    assert "buffer.max_staleness" in capsys.readouterr().err


def test_demo_sft_recipe_points_at_what_make_demo_builds(tmp_path):
    out = make_demo(tmp_path / "demo", train=50, eval=10)
    r = recipe.load(ROOT / "recipes/demo_sft.yaml", check_files=False)
    assert r.resolve(r.model.path).resolve() == (ROOT / "build/demo/model").resolve()
    # the same recipe with the freshly made folder passes the full file checks
    r = recipe.load(
        ROOT / "recipes/demo_sft.yaml",
        [
            f"model.path={out / 'model'}",
            f"data.path={out / 'data/train.jsonl'}",
            f"data.eval_path={out / 'data/eval.jsonl'}",
        ],
    )
    assert r.algorithm.loss == "sft"
    assert (out / "model/config.json").is_file()


def test_the_rlhf_demo_chains_its_stages_and_never_gives_the_answer_to_the_rl_reward(tmp_path):
    """`make demo-rlhf`: the pairs make_demo writes feed demo_rm; demo_rlhf starts from demo_sft's
    export, is scored by demo_rm's export alone (served by `asyncrl run`) and evaluated on exact
    match against the ground truth."""
    from tools.make_demo import make_pairs

    pairs = make_pairs(tmp_path / "pairs", train=20)
    assert len((pairs / "train.jsonl").read_text().splitlines()) == 20
    assert len((pairs / "eval.jsonl").read_text().splitlines()) == 500
    rm = recipe.load(ROOT / "recipes/demo_rm.yaml", check_files=False)
    assert rm.algorithm.loss == "reward_model"
    assert rm.resolve(rm.data.path).resolve() == (ROOT / "build/demo-rlhf/pairs/train.jsonl")
    rl = recipe.load(ROOT / "recipes/demo_rlhf.yaml", check_files=False)
    ro = rl.rollout
    assert ro.reward == "model" and ro.eval_reward == "exact_match" and not ro.reward_model.urls
    sft = recipe.load(ROOT / "recipes/demo_sft.yaml", check_files=False)
    # hf/latest links to the newest export: compare the paths the recipe names, links unresolved
    assert _norm(rl.resolve(ro.reward_model.path)) == ROOT / "runs" / rm.run.name / "hf/latest"
    assert _norm(rl.resolve(rl.model.path)) == ROOT / "runs" / sft.run.name / "hf/latest"


def _norm(p: Path) -> Path:
    return Path(os.path.normpath(p))


def test_the_distillation_demo_chains_its_stages_and_trains_on_no_task_reward():
    """`make demo-distill`: the student is demo_sft's export, the teacher demo's (served by
    `asyncrl run`), the budget demo's (so the two runs compare), and the outcome reward has no
    weight in the loss."""
    d = recipe.load(ROOT / "recipes/demo_distill.yaml", check_files=False)
    demo = recipe.load(ROOT / "recipes/demo.yaml", check_files=False)
    sft = recipe.load(ROOT / "recipes/demo_sft.yaml", check_files=False)
    assert d.algorithm.advantage == "distill" and d.algorithm.distill_coef == 0
    assert _norm(d.resolve(d.model.path)) == ROOT / "runs" / sft.run.name / "hf/latest"
    t = d.rollout.teacher
    assert _norm(d.resolve(t.path)) == ROOT / "runs" / demo.run.name / "hf/latest" and not t.urls
    for section, keys in {
        "run": ("steps",),
        "rollout": ("group_size", "max_new_tokens", "temperature"),
        "buffer": ("groups_per_batch", "max_staleness", "max_batches_ahead"),
        "learner": ("minibatches", "epochs"),  # the lr is the advantage's own (the recipe)
        "algorithm": ("loss",),
    }.items():
        for k in keys:
            assert getattr(getattr(d, section), k) == getattr(getattr(demo, section), k), k


def test_the_lora_demo_is_the_demo_with_adapters_and_their_learning_rate():
    """`make demo-lora`: demo.yaml with rank-8 adapters that export a PEFT folder; every other
    setting is the demo's (its name and the adapters' learning rate aside), so the runs compare."""
    import dataclasses

    lora = recipe.load(ROOT / "recipes/demo_lora.yaml", check_files=False)
    demo = recipe.load(ROOT / "recipes/demo.yaml", check_files=False)
    assert (lora.learner.lora.rank, lora.learner.lora.export) == (8, "adapter")
    assert not demo.learner.lora.enabled and lora.learner.lr > demo.learner.lr
    a, b = dataclasses.asdict(lora), dataclasses.asdict(demo)
    for d in (a, b):
        del d["run"]["name"], d["learner"]["lr"], d["learner"]["lora"]
    assert a == b


def test_the_moe_demo_chains_its_stages_on_an_moe_model_with_routing_replay(tmp_path):
    """`make demo-moe`: demo_moe_sft trains what `make_demo.py --arch qwen3_moe` builds, demo_moe
    starts from its export with routing replay on, and both pass the full file checks on that
    model (replay is refused on a dense one). Every RL setting but the replay, the paths and the
    names is the dense demo's, so the two demos compare."""
    import dataclasses
    import json

    out = make_demo(tmp_path / "demo_moe", train=50, eval=10, arch="qwen3_moe")
    cfg = json.loads((out / "model/config.json").read_text())
    assert (cfg["model_type"], cfg["num_experts_per_tok"]) == ("qwen3_moe", 2)
    assert cfg.get("num_experts", cfg.get("num_local_experts")) == 8
    data = [f"data.path={out / 'data/train.jsonl'}", f"data.eval_path={out / 'data/eval.jsonl'}"]
    sft = recipe.load(ROOT / "recipes/demo_moe_sft.yaml", [f"model.path={out / 'model'}", *data])
    assert sft.algorithm.loss == "sft"
    rl = recipe.load(ROOT / "recipes/demo_moe.yaml", [f"model.path={out / 'model'}", *data])
    assert rl.algorithm.routing_replay
    with pytest.raises(
        recipe.RecipeError, match=r"algorithm\.routing_replay: true, but model\.path is not"
    ):
        recipe.load(
            ROOT / "recipes/demo_moe.yaml",
            [f"model.path={make_demo(tmp_path / 'dense', train=50, eval=10) / 'model'}", *data],
        )
    rl = recipe.load(ROOT / "recipes/demo_moe.yaml", check_files=False)
    sft = recipe.load(ROOT / "recipes/demo_moe_sft.yaml", check_files=False)
    assert sft.resolve(sft.model.path).resolve() == (ROOT / "build/demo_moe/model").resolve()
    assert _norm(rl.resolve(rl.model.path)) == ROOT / "runs" / sft.run.name / "hf/latest"
    demo = recipe.load(ROOT / "recipes/demo.yaml", check_files=False)
    a, b = dataclasses.asdict(rl), dataclasses.asdict(demo)
    for d in (a, b):
        del d["run"]["name"], d["run"]["timeout_s"], d["model"]["path"], d["data"]["path"]
        del d["data"]["eval_path"], d["algorithm"]["routing_replay"]
    assert a == b
