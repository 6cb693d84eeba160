"""What each `asyncrl COMMAND` imports at its start, and how long that takes (issue #45 item 1).

    python tools/bench/import_time.py [--repeat 3] [--tree CHECKOUT ...] [COMMAND ...]

Each command's start-up (:data:`START`: the module `asyncrl COMMAND` imports, then the start-up
calls that import more: the learner builds its trainer and reads its held-out prompts, the worker
reads its jsonl prompts and loads its tokenizer, the engine loads its model) runs in a fresh
interpreter under ``python -X importtime``, one at a time, on a tiny Qwen3 and a 3-row jsonl made
in a temporary folder. Printed per command, the median of ``--repeat`` runs: the seconds spent
importing (the sum of ``-X importtime``'s self times: every module once), the interpreter's wall
and CPU (user + system) seconds, the module count and the packages that took longest. On a loaded
machine the wall-clock figures swing with the load; the CPU seconds and the module count much less.
``--tree``: the asyncrl checkout the children import (default this one); given more than once, the
trees take turns, run by run (a before/after comparison under the same load).
tests/test_imports.py runs the same start-ups against the packages each must not import.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

START = {
    "learner": """
        import asyncrl.learner.main
        from asyncrl.learner.config import TrainerConfig
        from asyncrl.learner.trainer import Trainer
        from asyncrl.rollout.held_out_eval import eval_rows

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
        import asyncrl.engine.server
        from asyncrl.engine.api import Engine, EngineConfig

        Engine.load(EngineConfig(model=RECIPE.model.path)).close()
    """,
    "run": "import asyncrl.launch",
    "check": "import asyncrl.check",
    "graph": "import asyncrl.graph",
    "doctor": "import asyncrl.doctor",
}
"""Per `asyncrl COMMAND`: its start-up, with ``RECIPE`` a recipe on a tiny model and jsonl prompts."""

_PRELUDE = """
import json, sys
from asyncrl import recipe as recipe_mod

RECIPE = recipe_mod.from_dict(json.loads(sys.argv[1]))
"""
_REPORT = """
print(json.dumps(sorted(sys.modules)))
"""
_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def start_code(command: str) -> str:
    """A ``python -c`` program: ``command``'s start-up, then ``sys.modules`` as a JSON line."""
    return _PRELUDE + textwrap.dedent(START[command]) + _REPORT


def run_start(
    command: str, recipe: dict, *, tree: Path = ROOT, importtime: bool = False
) -> tuple[set[str], str, float, float]:
    """Run ``command``'s start-up in a fresh interpreter that imports asyncrl from ``tree``:
    (the modules it held at the end, its stderr, its wall seconds, its CPU seconds)."""
    argv = [
        sys.executable,
        *(["-X", "importtime"] if importtime else []),
        "-c",
        start_code(command),
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(
        [*argv, json.dumps(recipe)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tree,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree)},
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if p.returncode != 0:
        raise RuntimeError(f"{command}'s start-up failed:\n{p.stderr[-3000:]}")
    return set(json.loads(p.stdout.strip().splitlines()[-1])), p.stderr, wall, cpu


def make_recipe(folder: Path, model: Path) -> dict:
    """A recipe on ``model`` with a 3-row jsonl as its training and held-out prompts."""
    rows = [json.dumps({"prompt": f"{c}=", "answer": c}) for c in "abc"]
    (folder / "train.jsonl").write_text("\n".join(rows) + "\n")
    return {
        "model": {"path": str(model), "max_seq_len": 64},
        "data": {"path": str(folder / "train.jsonl"), "eval_path": str(folder / "train.jsonl")},
        "run": {"output_dir": str(folder / "runs"), "eval_prompts": 3},
    }


def import_seconds(stderr: str) -> tuple[float, dict[str, float]]:
    """``-X importtime`` lines: the total of the self times, and that total per top-level package."""
    by_package: collections.Counter[str] = collections.Counter()
    for m in _LINE.finditer(stderr):
        by_package[m[4].split(".")[0]] += int(m[1]) / 1e6
    return sum(by_package.values()), dict(by_package)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("commands", nargs="*", help=f"of {', '.join(START)} (default: all)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tree", type=Path, action="append", help="an asyncrl checkout to import")
    a = ap.parse_args(argv)
    if unknown := set(a.commands) - set(START):
        ap.error(f"not a command: {', '.join(sorted(unknown))}")
    trees = a.tree or [ROOT]
    sys.path.insert(0, str(ROOT))
    from tools.make_tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "model").mkdir()
        recipe = make_recipe(Path(tmp), make_tiny_model(Path(tmp) / "model", arch="qwen3"))
        print(f"# median of {a.repeat}; trees: " + ", ".join(str(t.resolve()) for t in trees))
        for command in a.commands or list(START):
            runs: dict[Path, list] = {t: [] for t in trees}
            for _ in range(a.repeat):
                for tree in trees:
                    modules, stderr, wall, cpu = run_start(
                        command, recipe, tree=tree, importtime=True
                    )
                    runs[tree].append((*import_seconds(stderr), wall, cpu, len(modules)))
            for tree, rs in runs.items():
                total = statistics.median(r[0] for r in rs)
                packages = {p: statistics.median(r[1].get(p, 0.0) for r in rs) for p in rs[0][1]}
                top = sorted(packages.items(), key=lambda kv: -kv[1])[:8]
                print(
                    f"{command} [{tree.name}]: imports {total:.2f} s "
                    f"(runs {', '.join(f'{r[0]:.2f}' for r in rs)}), "
                    f"wall {statistics.median(r[2] for r in rs):.2f} s, "
                    f"CPU {statistics.median(r[3] for r in rs):.2f} s, {rs[0][4]} modules; "
                    + ", ".join(f"{p} {s:.2f}" for p, s in top),
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
