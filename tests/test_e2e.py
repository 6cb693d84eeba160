"""End to end: `asyncrl run` with real processes (learner, buffer, rollout worker, built-in engine).

Each test builds the demo's tiny model and a small data set in a temporary folder, runs the recipe
with overrides that keep it to a few steps, and checks what a user gets: the run folder, summary.json,
metrics.jsonl, the W&B offline run read back, plots, and no process left behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl import launch, metrics
from tools.make_demo import make_demo

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    return make_demo(tmp_path_factory.mktemp("demo"), train=2000, eval=64)


def _paths(demo: Path, model: Path | None = None) -> list[str]:
    return [
        f"model.path={model or demo / 'model'}",
        f"data.path={demo / 'data/train.jsonl'}",
        f"data.eval_path={demo / 'data/eval.jsonl'}",
    ]


def _pgroup_alive(pgid: int) -> bool:
    """Is any process of process group ``pgid`` still running (zombies excluded)?"""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def _no_children_left(run_dir: Path) -> None:
    pids = json.loads((run_dir / "logs/pids.json").read_text())
    assert pids, "the launcher recorded no children"
    alive = {name: pid for name, pid in pids.items() if _pgroup_alive(pid)}
    assert not alive, f"process groups still running: {alive}"


def test_sft_run_leaves_a_complete_run_folder(tmp_path, demo_dir):
    steps = 12
    ov = [
        *_paths(demo_dir),
        f"run.output_dir={tmp_path}",
        f"run.steps={steps}",
        "run.eval_prompts=32",
    ]
    s = launch.run(ROOT / "recipes/demo_sft.yaml", ov, progress=False)
    run_dir = tmp_path / "demo_sft"
    assert s["outcome"] == "completed" and s["steps"] == steps
    on_disk = json.loads((run_dir / "summary.json").read_text())
    for key in ("steps", "reward_start", "reward_end", "max_staleness_allowed", "wall_seconds"):
        assert key in on_disk
    assert on_disk["trained_tokens_per_s"] > 0
    assert 0.0 <= on_disk["reward_start"] <= 1.0 and 0.0 <= on_disk["reward_end"] <= 1.0
    learner = metrics.read_metrics(run_dir, process="learner")
    assert [r["step"] for r in learner] == list(range(1, steps + 1))
    assert all(r["loss"] > 0 for r in learner)
    assert learner[-1]["loss"] < learner[0]["loss"]  # the SFT loss goes down
    # W&B offline run: the same steps and losses as the JSONL
    (wb,) = [w for w in metrics.read_wandb_offline(run_dir) if w["job_type"] == "learner"]
    hist = [h for h in wb["history"] if "loss" in h]
    assert [h["step"] for h in hist] == list(range(1, steps + 1))
    assert hist[-1]["loss"] == pytest.approx(learner[-1]["loss"])
    assert (run_dir / "hf/latest/config.json").is_file()
    assert (run_dir / "plots/learning.png").is_file()
    _no_children_left(run_dir)
