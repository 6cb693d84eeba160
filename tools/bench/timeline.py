"""When each part of one `asyncrl run` happens: start-up, training and the end, seen from outside.

Runs ``asyncrl run RECIPE --overwrite`` and polls the run folder every 50 ms for what each process
writes when it gets somewhere (the learner's "listening on", the engine's "serving", the worker's
"registered", the first and last trained step in metrics.jsonl, summary.json) and for each child's
exit (logs/pids.json). Prints seconds since spawn per event, then where the training window went
(the learner's step seconds, its waits for data, held-out evaluation). The last line is JSON:

    {"bench": "timeline", "events": {...}, "steps": ..., "window_s": ..., "step_s": ..., ...}

    python tools/bench/timeline.py recipes/demo.yaml [key=value ...]

Run it on a quiet machine: start-up on 2 cores is bound by the CPU the three processes' imports
take, so any other load moves every figure. For where the CPU goes inside a process, sample it with
py-spy (in an environment of its own: ``py-spy record --format raw --pid PID``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from asyncrl import recipe as recipe_mod  # noqa: E402
from asyncrl.metrics import read_metrics  # noqa: E402

# event -> (file under the run folder, or None for the engines' logs; text that marks it)
MARKS: dict[str, tuple[str | None, str]] = {
    "learner listening": ("logs/learner.log", "listening on"),
    "engine serving": (None, "serving"),
    "worker registered": ("logs/rollout0.log", "registered"),
    "first step": ("metrics.jsonl", "learner/step_s"),
    "summary written": ("summary.json", "outcome"),
}


def _text(run_dir: Path, rel: str | None) -> str:
    paths = sorted((run_dir / "logs").glob("engine-*.log")) if rel is None else [run_dir / rel]
    out = []
    for p in paths:
        try:
            out.append(p.read_text(errors="replace"))
        except OSError:
            pass
    return "".join(out)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipe", type=Path)
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. run.steps=20")
    a = p.parse_args(argv)
    run_dir = recipe_mod.load(a.recipe, a.overrides).run_dir
    shutil.rmtree(run_dir, ignore_errors=True)  # no mark may come from an older run
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", str(a.recipe), *a.overrides]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [*cmd, "--overwrite", "--no-progress"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    seen: dict[str, float] = {}
    pids: dict[str, int] = {}
    while proc.poll() is None:
        now = time.monotonic() - t0
        for name, (rel, mark) in MARKS.items():
            if name not in seen and mark in _text(run_dir, rel):
                seen[name] = now
        try:
            for name, pid in json.loads((run_dir / "logs/pids.json").read_text()).items():
                pids.setdefault(name, pid)
        except (OSError, ValueError):  # not written yet, or being rewritten
            pass
        for name, pid in pids.items():
            if f"{name} exited" not in seen and not _alive(pid):
                seen[f"{name} exited"] = now
        time.sleep(0.05)
    seen["launcher exited"] = time.monotonic() - t0
    if proc.returncode:
        raise SystemExit(f"timeline: asyncrl run exited with code {proc.returncode}")
    records = read_metrics(run_dir)
    steps = [r for r in records if "learner/step_s" in r]
    first = steps[0]["time"] - seen["first step"]  # wall clock of the spawn, as the learner saw it
    seen["last step"] = steps[-1]["time"] - first
    window = steps[-1]["time"] - steps[0]["time"]
    figures = {
        "steps": len(steps),
        "window_s": round(window, 2),
        "step_s": round(sum(r["learner/step_s"] for r in steps), 2),
        "wait_s": round(sum(r.get("buffer/wait_s", 0.0) for r in steps), 2),
        "eval_s": round(sum(r.get("eval/seconds", 0.0) for r in records), 2),
    }
    events = dict(sorted(((k, round(v, 2)) for k, v in seen.items()), key=lambda kv: kv[1]))
    for name, s in events.items():
        print(f"{name:24s} {s:7.2f} s")
    print(
        f"training window (first to last step) {figures['window_s']} s: learner steps "
        f"{figures['step_s']} s, waiting for data {figures['wait_s']} s; held-out evaluation "
        f"{figures['eval_s']} s (beside training, on the generators)"
    )
    print(json.dumps({"bench": "timeline", "events": events, **figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
