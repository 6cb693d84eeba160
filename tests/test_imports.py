"""Each asyncrl process imports only what its path uses (issue #45 item 1, BENCHMARKS.md session 17).

One fresh interpreter per entry point runs what that process does at its start
(tools/bench/import_time.py's ``START``: the module `asyncrl COMMAND` imports, then the start-up
calls that import more: the learner builds its trainer and reads its held-out prompts, the worker
reads its prompts and loads its tokenizer, the engine loads its model) and reports ``sys.modules``;
a package the path must not import fails the test, so an import set that grows past the list below
is seen here, not in a run's start-up time. The import graph inside asyncrl is
tests/test_import_graph.py's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench.import_time import START, make_recipe, run_start

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


def unwanted(modules: set[str], packages: set[str]) -> list[str]:
    """The packages of ``packages`` that ``modules`` holds, themselves or by a submodule."""
    return sorted(p for p in packages if any(m == p or m.startswith(p + ".") for m in modules))


@pytest.fixture(scope="module")
def recipe(tiny_qwen3, tmp_path_factory) -> dict:
    return make_recipe(tmp_path_factory.mktemp("imports"), tiny_qwen3)


def test_every_command_is_listed() -> None:
    from asyncrl.cli import COMMANDS

    assert set(NOT_IMPORTED) == set(START) == set(COMMANDS)


@pytest.mark.parametrize("command", list(START))
def test_a_process_start_imports_only_what_its_path_uses(command: str, recipe: dict) -> None:
    found = unwanted(run_start(command, recipe)[0], NOT_IMPORTED[command])
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
from asyncrl.learner.model_spec import build_spec

spec = build_spec({str(tiny_qwen3)!r}, max_seq_len=64)
par = ParallelismConfig()
ours, theirs = copy.deepcopy(spec.model), copy.deepcopy(spec.model)
update_from_config(ours, par)
assert "torchtitan.trainer" not in sys.modules
import torchtitan.trainer
assert torchtitan.trainer.Trainer.__module__ == "torchtitan.trainer"  # the real one
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
