"""Each asyncrl process imports only what its path uses (issue #45 item 1, BENCHMARKS.md session 17).

One fresh interpreter per entry point runs what that process does at its start (the module `asyncrl
COMMAND` imports, then the start-up calls that import more: the learner builds its trainer and
reads its held-out prompts, the worker reads its prompts and loads its tokenizer, the engine loads
its model) and prints ``sys.modules``; a package the path must not import fails the test, so an
import set that grows past the list below is seen here, not in a run's start-up time. The import
graph inside asyncrl is tests/test_import_graph.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

DATA = {"datasets", "pandas", "pyarrow"}  # prompts in jsonl are read without them
TITAN_TRAINER = {"torchtitan.trainer", "tensorboard", "torchdata"}  # TorchTitan's trainer, not used
WHEN_USED = {"wandb", "matplotlib"}  # W&B at its init, plots at a run's end
MODELS = {"torch", "transformers", "torchtitan"}

NOT_IMPORTED: dict[str, set[str]] = {
    "learner": DATA | TITAN_TRAINER | WHEN_USED,
    "rollout": DATA | TITAN_TRAINER | WHEN_USED | {"torchtitan"},
    "engine": DATA | TITAN_TRAINER | WHEN_USED | {"torchtitan"},
    "run": DATA | TITAN_TRAINER | WHEN_USED | MODELS,
    "check": DATA | TITAN_TRAINER | WHEN_USED | MODELS,
    "graph": DATA | TITAN_TRAINER | WHEN_USED | MODELS,
    "doctor": DATA | TITAN_TRAINER | WHEN_USED | MODELS,
}
"""Per `asyncrl COMMAND`: packages its start-up must not import (a package and its submodules)."""

START = {
    "learner": """
        import asyncrl.learner.main
        from asyncrl.learner.config import TrainerConfig
        from asyncrl.learner.trainer import Trainer
        from asyncrl.rollout.evaluation import eval_rows

        Trainer(TrainerConfig.from_recipe(RECIPE), checkpointing=False)
        assert eval_rows(RECIPE)
    """,
    "rollout": """
        import asyncrl.rollout.main as m
        from transformers import AutoTokenizer  # as main() loads it

        assert len(m.build_source(RECIPE, (0, 1))) == 3
        AutoTokenizer.from_pretrained(RECIPE.model.path)
    """,
    "engine": """
        import asyncrl.rollout.engine.server
        from asyncrl.rollout.engine.api import Engine, EngineConfig

        Engine.load(EngineConfig(model=RECIPE.model.path)).close()
    """,
    "run": "import asyncrl.launch",
    "check": "import asyncrl.check",
    "graph": "import asyncrl.graph",
    "doctor": "import asyncrl.doctor",
}
"""Per `asyncrl COMMAND`: its start-up, with ``RECIPE`` a recipe on a tiny model and jsonl prompts."""

PRELUDE = """
import json, sys
from asyncrl import recipe as recipe_mod

RECIPE = recipe_mod.from_dict(json.loads(sys.argv[1]))
"""
REPORT = """
print(json.dumps(sorted(sys.modules)))
"""


def imported(command: str, recipe: dict) -> set[str]:
    """The modules a fresh interpreter holds after ``command``'s start-up."""
    code = PRELUDE + textwrap.dedent(START[command]) + REPORT
    p = subprocess.run(
        [sys.executable, "-c", code, json.dumps(recipe)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return set(json.loads(p.stdout.strip().splitlines()[-1]))


def unwanted(modules: set[str], packages: set[str]) -> list[str]:
    """The packages of ``packages`` that ``modules`` holds, themselves or by a submodule."""
    return sorted(p for p in packages if any(m == p or m.startswith(p + ".") for m in modules))


@pytest.fixture(scope="module")
def recipe(tiny_qwen3, tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("imports")
    rows = [json.dumps({"prompt": f"{c}=", "answer": c}) for c in "abc"]
    (d / "train.jsonl").write_text("\n".join(rows) + "\n")
    return {
        "model": {"path": str(tiny_qwen3), "max_seq_len": 64},
        "data": {"path": str(d / "train.jsonl"), "eval_path": str(d / "train.jsonl")},
        "run": {"output_dir": str(d / "runs"), "eval_prompts": 3},
    }


def test_every_command_is_listed() -> None:
    from asyncrl.cli import COMMANDS

    assert set(NOT_IMPORTED) == set(START) == set(COMMANDS)


@pytest.mark.parametrize("command", list(START))
def test_a_process_start_imports_only_what_its_path_uses(command: str, recipe: dict) -> None:
    found = unwanted(imported(command, recipe), NOT_IMPORTED[command])
    assert not found, f"asyncrl {command}'s start-up imports {', '.join(found)}"


def test_the_check_sees_a_package_through_its_submodules() -> None:
    assert unwanted({"pandas.core.frame", "pandasx", "torch"}, {"pandas", "wandb"}) == ["pandas"]


def test_the_learner_updates_its_model_config_as_torchtitan_does(tiny_qwen3) -> None:
    """asyncrl.learner.build.update_from_config without ``torchtitan.trainer`` leaves the model's
    config as TorchTitan's own method does with the real module loaded, and leaves no stand-in."""
    code = f"""
import copy, sys
from types import SimpleNamespace
from torchtitan.config import ParallelismConfig
from asyncrl.learner.build import update_from_config
from asyncrl.learner.model import build_spec

spec = build_spec({str(tiny_qwen3)!r}, max_seq_len=64)
par = ParallelismConfig()
ours, theirs = copy.deepcopy(spec.model), copy.deepcopy(spec.model)
update_from_config(ours, par)
assert "torchtitan.trainer" not in sys.modules
import torchtitan.trainer
assert hasattr(torchtitan.trainer.Trainer, "Config") and torchtitan.trainer.Trainer.__module__ == "torchtitan.trainer"
theirs.update_from_config(config=SimpleNamespace(parallelism=par))
assert repr(ours) == repr(theirs)  # its param_init partials compare by identity
again = copy.deepcopy(spec.model)
update_from_config(again, par)  # the real module loaded: used as it is
assert repr(again) == repr(theirs)
print("same")
"""
    p = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )
    assert p.returncode == 0 and p.stdout.strip().endswith("same"), p.stderr[-3000:]
