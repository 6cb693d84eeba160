"""Where the spread of asyncrl's held-out reward comes from, against TRL's (issue #45).

TRL's GRPOTrainer gives the same held-out reward every time it runs with one seed: one process, one
random stream. asyncrl's varies run to run at one seed, because which policy version samples which
group, and in what order groups reach a batch, follow the processes' timing. This bench runs the
vs_trl job (tools/bench/vs_trl.py: the same start model, data, reward, batch, lr and steps) under
conditions that take those sources apart, ``--runs`` times each, and scores every final model on
the demo's held-out prompts (greedy):

- ``trl-seeds``: TRL, seeds 0..N-1: the spread of the algorithm and task over seeds alone;
- ``async-one-seed``: asyncrl as vs_trl runs it (max_staleness 4), seed 0 every time: timing alone;
- ``async-seeds``: asyncrl, seeds 0..N-1: timing and seeds;
- ``onpolicy-one-seed``: asyncrl with ``buffer.max_staleness=0`` (every trained token from the
  version being updated), seed 0 every time: timing without staleness (only the order of groups and
  which engine slot draws which random numbers are left to vary).

Two more, not run unless named, try remedies at seed 0: ``staleness1-one-seed``
(``buffer.max_staleness=1``) and ``minibatches2-one-seed`` (``learner.minibatches=2``: two updates
per batch, so decoupled PPO's clip around π_prox acts; with one, the demo's loss is truncated IS).

Prints per condition the held-out rewards, their median, range and standard deviation, and the
batch reward's last 5-step mean; the last line is JSON. Conditions run interleaved (one run of each
in turn) so that load from elsewhere falls on all of them.

    python tools/bench/spread.py [--size demo|mid] [--runs 5] [--steps 60]
        [--conditions trl-seeds,async-one-seed,async-seeds,onpolicy-one-seed]  # the default
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.bench.vs_trl import (  # noqa: E402
    OUT,
    _f,
    ensure_start,
    ensure_trl_env,
    heldout,
    run_asyncrl,
    run_trl,
    running_mean,
)

CONDITIONS: dict[str, tuple[list[str], bool] | None] = {
    "trl-seeds": None,  # TRL, seed i
    "async-one-seed": ([], False),  # asyncrl: its overrides, and whether run i takes seed i
    "async-seeds": ([], True),
    "onpolicy-one-seed": (["buffer.max_staleness=0"], False),
    "staleness1-one-seed": (["buffer.max_staleness=1"], False),
    "minibatches2-one-seed": (["learner.minibatches=2"], False),
}
DEFAULT = ("trl-seeds", "async-one-seed", "async-seeds", "onpolicy-one-seed")


def run_one(condition: str, i: int, *, py: str, start: Path, steps: int, size: str) -> dict:
    tag = f"spread_{size}_{condition}_{i}"
    spec = CONDITIONS[condition]
    if spec is None:
        r = run_trl(py, start, steps, 1, tag, seed=i)
    else:
        overrides, seeds = spec
        r = run_asyncrl(start, steps, [f"run.seed={i if seeds else 0}", *overrides], tag)
    return {
        "heldout": heldout(r["model"], OUT / f"{tag}_eval.log"),
        "reward_last": running_mean(r["reward"], 5)[-1] if r["reward"] else None,
        "wall": r["wall"],
    }


def describe(values: list[float]) -> dict:
    return {
        "values": [round(v, 3) for v in values],
        "median": statistics.median(values),
        "range": max(values) - min(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=["demo", "mid"], default="demo")
    p.add_argument("--runs", type=int, default=5, help="runs per condition")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--conditions", default=",".join(DEFAULT), help=", ".join(CONDITIONS))
    a = p.parse_args(argv)
    conditions = [c for c in a.conditions.split(",") if c]
    unknown = sorted(set(conditions) - set(CONDITIONS))
    if unknown:
        p.error(f"--conditions: unknown {', '.join(unknown)} (choose from {', '.join(CONDITIONS)})")
    py = ensure_trl_env() if any(CONDITIONS[c] is None for c in conditions) else ""
    start = ensure_start(a.size)
    OUT.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {c: [] for c in conditions}
    for i in range(a.runs):
        for c in conditions:
            r = run_one(c, i, py=py, start=start, steps=a.steps, size=a.size)
            results[c].append(r)
            print(
                f"{c:20} run {i}: held-out {_f(r['heldout'], '.3f')}  batch reward (last 5) "
                f"{_f(r['reward_last'], '.3f')}  wall {r['wall']:.1f} s",
                flush=True,
            )
    summary = {}
    print(f"\n{'condition':20}{'median':>8}{'range':>8}{'std':>8}  held-out values")
    for c in conditions:
        d = describe([r["heldout"] for r in results[c] if r["heldout"] is not None])
        d["reward_last_median"] = statistics.median(r["reward_last"] for r in results[c])
        summary[c] = d
        print(f"{c:20}{d['median']:8.3f}{d['range']:8.3f}{d['std']:8.3f}  {d['values']}")
    print(json.dumps({"bench": "spread", "size": a.size, "runs": a.runs, "conditions": summary}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
