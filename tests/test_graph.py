"""`asyncrl graph`: prints every call by level and writes a valid PNG; a bad recipe is one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from asyncrl import dataflow, recipe
from asyncrl.graph import main

DEMO = Path(__file__).resolve().parents[1] / "recipes" / "demo.yaml"
PPO = """\
run: {name: ppo, steps: 2}
algorithm: {loss: ppo, advantage: gae, gamma: 1.0, lam: 0.95, kl_reward_coef: 0.05}
"""


def _valid_png(path: Path) -> tuple[int, int]:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        return im.size


@pytest.mark.parametrize("which", ["demo", "ppo"])
def test_graph_prints_every_call_and_writes_a_png(tmp_path, capsys, which):
    path = DEMO
    if which == "ppo":
        path = tmp_path / "ppo.yaml"
        path.write_text(PPO)
    out = tmp_path / "g.png"
    assert main([str(path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    flow = dataflow.from_recipe(recipe.load(path, check_files=False))
    for c in flow.calls:
        assert f"{c.name}: {c.label}" in printed
    w, h = _valid_png(out)
    assert w > 300 and h > 100
    if which == "ppo":
        assert "ppo with a critic (gae, kl reward)" in printed
        assert "[1] values: critic.inference" in printed
        assert "[3] train_critic: critic.train_step" in printed


def test_graph_default_png_sits_next_to_the_run_folder(tmp_path, capsys):
    runs = tmp_path / "runs"
    assert main([str(DEMO), f"run.output_dir={runs}", "run.name=d"]) == 0
    _valid_png(runs / "d.dataflow.png")
    assert not (runs / "d").exists()  # `asyncrl run` wants a fresh run folder
    assert str(runs / "d.dataflow.png") in capsys.readouterr().err


def test_graph_bad_recipe_is_one_line_not_a_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithm: {advantage: gea}\n")
    p = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "graph", str(bad), "--out", str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "algorithm.advantage" in lines[0] and "did you mean 'gae'" in lines[0]
    assert not (tmp_path / "x.png").exists()


def test_graph_unwritable_out_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main([str(DEMO), "--out", str(blocker / "g.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("asyncrl graph: cannot write")


def test_graph_says_where_each_call_runs(tmp_path, capsys):
    """With a placement, each learner call carries its role's ranks and layout; generation and
    rewards run in the rollout workers, the advantages on every learner rank."""
    path = tmp_path / "ppo.yaml"
    path.write_text(PPO)
    placed = [
        "learner.ranks=8",
        "placement.actor.ranks=[0,1,2,3,4,5]",
        "placement.actor.tensor_parallel=2",
        "placement.critic.ranks=[6,7]",
        "placement.critic.offload=true",
    ]
    assert main([str(path), *placed, "--out", str(tmp_path / "g.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = {x.split(":")[0].split()[-1]: x.rsplit("  @ ", 1)[1] for x in lines[1:]}
    assert at == {
        "generate": "rollout workers' generators",
        "reward_fn": "rollout workers",
        "values": "ranks 6-7, TP 1 × DP 2, offloaded between calls",
        "ref": "ranks 0-5, TP 2 × DP 3",  # laid out as the actor
        "prox": "ranks 0-5, TP 2 × DP 3",  # the KL reward's log π_prox
        "advantages": "every learner rank",
        "train_actor": "ranks 0-5, TP 2 × DP 3",
        "train_critic": "ranks 6-7, TP 1 × DP 2, offloaded between calls",
    }
    _valid_png(tmp_path / "g.png")


def test_graph_of_the_distillation_demo_shows_the_teacher(tmp_path, capsys):
    """`asyncrl graph recipes/demo_distill.yaml`: the teacher's call, where it runs, its colour."""
    path = DEMO.with_name("demo_distill.yaml")
    assert main([str(path), "--out", str(tmp_path / "g.png")]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("on-policy distillation: data provides prompts, answers")
    assert (
        "[1] teacher: teacher.inference prompts, responses -> teacher_logp  "
        "@ rollout workers (rollout.teacher's servers)"
    ) in printed
    assert "[2] advantages: driver.compute behavior_logp, teacher_logp -> advantages" in printed
    _valid_png(tmp_path / "g.png")
