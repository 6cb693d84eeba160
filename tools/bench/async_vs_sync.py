"""Asynchronous (eta = 4) against synchronous (eta = 0) RL: the demo's RL stage, side by side.

Both runs start from the same SFT checkpoint with the same seeds and train the same number of samples
(``run.steps`` x ``buffer.groups_per_batch`` x ``rollout.group_size``); only ``buffer.max_staleness``
differs. Prints wall-clock seconds, trained samples/s, learner and generator idle fractions and the
final held-out success of both; the last line is JSON:

    {"bench": "async_vs_sync", "speedup": ..., "reward_sync": ..., "reward_async": ...}

    python tools/bench/async_vs_sync.py [--steps 100] [--eta 4] [key=value ...]

Builds the demo model, data and SFT checkpoint first if `make demo` has not (runs/demo_sft).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from asyncrl import launch, plots, recipe  # noqa: E402
from asyncrl import metric_names as names  # noqa: E402
from tools.make_demo import make_demo  # noqa: E402


def ensure_sft() -> None:
    """The demo's stage 1 (model, data, SFT export), unless it is already there."""
    make_demo(ROOT / "build/demo")
    if not (ROOT / "runs/demo_sft/hf/latest/config.json").is_file():
        s = launch.run(ROOT / "recipes/demo_sft.yaml", [], overwrite=True, progress=False)
        if s["outcome"] != "completed":
            raise SystemExit(f"async_vs_sync: the SFT stage did not complete: {s['outcome']}")


def _mean_of(ys: list[float], *, skip_first: int = 2) -> float | None:
    ys = ys[skip_first:] if len(ys) > skip_first else ys
    return sum(ys) / len(ys) if ys else None


def one_run(eta: int, steps: int, overrides: list[str]) -> dict:
    name = f"bench_async_vs_sync_eta{eta}"
    ov = [
        f"run.name={name}",
        f"run.steps={steps}",
        f"buffer.max_staleness={eta}",
        "learner.checkpoint_every=0",
        *overrides,
    ]
    s = launch.run(ROOT / "recipes/demo.yaml", ov, overwrite=True, progress=False)
    run_dir = Path(s.get("run_dir") or ROOT / "runs" / name)
    records = plots.read_metrics(run_dir / "metrics.jsonl")
    r = recipe.load(ROOT / "recipes/demo.yaml", ov)
    per_step = r.buffer.groups_per_batch * r.rollout.group_size
    samples = s["steps"] * per_step
    # steady state: the learner's steps after its first (start-up excluded), over their time
    train_s = s.get("train_seconds")
    timed = s.get("train_steps_timed") or 0
    return {
        "eta": eta,
        "outcome": s["outcome"],
        "steps": s["steps"],
        "wall_seconds": s["wall_seconds"],
        "train_seconds": train_s,
        "trained_samples": samples,
        "trained_samples_per_s": timed * per_step / train_s if train_s else None,
        "learner_idle": _mean_of(plots.learner_idle_series(records)[1]),
        "generator_idle": _mean_of(plots.series(records, names.GENERATOR_IDLE)[1]),
        "max_staleness_seen": s["max_staleness_seen"],
        "reward_start": s["reward_start"],
        "reward_end": s["reward_end"],
    }


def _f(v, spec=".3f") -> str:
    return "-" if v is None else format(v, spec)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="optimizer steps of each run")
    p.add_argument("--eta", type=int, default=4, help="max_staleness of the asynchronous run")
    p.add_argument("overrides", nargs="*", help="recipe overrides for both runs")
    a = p.parse_args(argv)
    ensure_sft()
    load0 = os.getloadavg()[0]
    sync = one_run(0, a.steps, a.overrides)
    asyn = one_run(a.eta, a.steps, a.overrides)
    load1 = os.getloadavg()[0]
    # the speedup needs a free core for the generator while the learner trains: on a machine
    # shared with other jobs (load above the core count) both runs just share the contention
    print(f"load average (1 min) at start {load0:.1f}, at end {load1:.1f}; cores {os.cpu_count()}")
    print(f"{'':28}{'sync (eta 0)':>16}{f'async (eta {a.eta})':>16}")
    rows = [
        ("outcome", "outcome", "s"),
        ("steps", "steps", "d"),
        ("trained samples", "trained_samples", "d"),
        ("wall seconds (whole run)", "wall_seconds", ".1f"),
        ("training seconds", "train_seconds", ".1f"),
        ("trained samples/s", "trained_samples_per_s", ".1f"),
        ("learner idle fraction", "learner_idle", ".3f"),
        ("generator idle fraction", "generator_idle", ".3f"),
        ("max staleness seen", "max_staleness_seen", "g"),
        ("held-out success, start", "reward_start", ".3f"),
        ("held-out success, end", "reward_end", ".3f"),
    ]
    for label, key, spec in rows:
        print(f"{label:28}{_f(sync[key], spec):>16}{_f(asyn[key], spec):>16}")
    speedup = (
        asyn["trained_samples_per_s"] / sync["trained_samples_per_s"]
        if asyn["trained_samples_per_s"] and sync["trained_samples_per_s"]
        else None
    )
    print(
        json.dumps(
            {
                "bench": "async_vs_sync",
                "speedup": speedup,
                "reward_sync": sync["reward_end"],
                "reward_async": asyn["reward_end"],
                "eta": a.eta,
                "load_avg": [round(load0, 1), round(load1, 1)],
                "steps": a.steps,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
