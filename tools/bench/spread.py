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

**The hard start** (issue #53, ``--start hard``): the same task from a model SFT'd for only
``--sft-steps`` steps (default 60 of recipes/demo_sft.yaml's 250), whose held-out success is low
(0.12), so early progress compounds and a lag costs most; the start's own held-out success is
measured and printed first. Its conditions (:data:`HARD`, seed i in run i) set the buffer
explicitly, since demo.yaml's ``max_batches_ahead: 2`` is not the recipe default:
``onpolicy`` (η = 0), ``eta4`` (η = 4, depth η + 1 = 5), ``eta4-depth2`` (demo.yaml as it is),
``eta4-depth1`` (each a fixed depth), ``eta4-wait`` (the recipe's default depth: by the learner's waits),
the freshest groups first (``newest``: depth 5; ``eta4-depth2-newest``), each remedy on ``eta4``
(``m2po``, ``anchor``: decoupled_ppo's staleness anchor, ``esslr``: the ESS-scaled lr,
``adaptive``: the depth by the drift), the anchor on the default depth (``wait-anchor``: demo.yaml's
algorithm since Session 24; every other condition recomputes π_prox, :data:`PINNED`), and ``eta16``
(η = 16, depth 17) alone and with ``m2po``, ``adaptive``, ``anchor`` and the wait-driven depth
(``eta16-wait``; with the anchor ``eta16-wait-anchor``). Prints the median held-out and median wall
of each. ``--first-run K`` numbers the runs (and seeds) from K, to add seeds to an earlier bench's;
``--set KEY=VALUE`` adds a recipe override to every asyncrl condition (``--label`` keeps that
variant's run folders apart).

    python tools/bench/spread.py --start hard --size mid --runs 5 --steps 50 \
        --conditions onpolicy,eta4,eta4-depth2,m2po,anchor,esslr,adaptive,eta16,eta16-m2po,eta16-adaptive
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

FIXED = "buffer.adaptive_depth_wait=false"  # the depth held at max_batches_ahead
ETA4 = ["buffer.max_staleness=4", "buffer.max_batches_ahead=0", FIXED]  # depth η + 1 (AReaL)
ETA16 = ["buffer.max_staleness=16", "buffer.max_batches_ahead=0", FIXED]  # depth 17: that stale
ADAPTIVE = ["buffer.adaptive_depth_ess=0.9", "buffer.adaptive_depth_kl=0.05"]
HARD: dict[str, tuple[list[str], bool]] = {
    "onpolicy": (["buffer.max_staleness=0"], True),
    "eta4": (ETA4, True),
    "eta4-depth2": (["buffer.max_staleness=4", "buffer.max_batches_ahead=2", FIXED], True),
    "eta4-depth1": (["buffer.max_staleness=4", "buffer.max_batches_ahead=1", FIXED], True),
    # the recipe's default depth (the learner's waits), π_prox recomputed: Session 23's default
    "eta4-wait": (["buffer.max_staleness=4", "buffer.max_batches_ahead=0"], True),
    "newest": ([*ETA4, "buffer.batch_order=newest"], True),
    "eta4-depth2-newest": (
        [
            "buffer.max_staleness=4",
            "buffer.max_batches_ahead=2",
            "buffer.batch_order=newest",
            FIXED,
        ],
        True,
    ),
    "m2po": ([*ETA4, "algorithm.loss=m2po"], True),
    "anchor": ([*ETA4, "algorithm.prox_anchor=staleness"], True),
    "wait-anchor": (  # the default depth with the staleness anchor: demo.yaml since Session 24
        ["buffer.max_staleness=4", "buffer.max_batches_ahead=0", "algorithm.prox_anchor=staleness"],
        True,
    ),
    "esslr": ([*ETA4, "learner.lr_ess_scale=sqrt"], True),
    "adaptive": ([*ETA4, *ADAPTIVE], True),
    "eta16": (ETA16, True),
    "eta16-m2po": ([*ETA16, "algorithm.loss=m2po"], True),
    "eta16-adaptive": ([*ETA16, *ADAPTIVE], True),
    "eta16-anchor": ([*ETA16, "algorithm.prox_anchor=staleness"], True),
    "eta16-wait": (["buffer.max_staleness=16", "buffer.max_batches_ahead=0"], True),
    "eta16-wait-anchor": (
        [
            "buffer.max_staleness=16",
            "buffer.max_batches_ahead=0",
            "algorithm.prox_anchor=staleness",
        ],
        True,
    ),
}
"""``--start hard``'s conditions (issue #53): every one at seed i in run i."""
CONDITIONS.update(HARD)
PINNED = ("algorithm.prox_anchor=recompute",)
"""What a :data:`HARD` condition runs with unless it sets it: the algorithm Sessions 22 and 23
measured them with (demo.yaml's π_prox is the staleness anchor since Session 24, so ``wait-anchor``
is its default), so that their figures reproduce."""
HARD_DEFAULT = tuple(HARD)
HARD_SFT_STEPS = 60
"""SFT steps of the hard start (the mid bench's 250 give 0.20 held-out success). Held-out success of
the mid model by SFT steps (2026-12-07): 60: 0.12, 40: 0.08, 30: 0.054, 20: 0.044, 15: 0.024,
12: 0.004 (the issue's 0.003), 10: 0.0. From 12, 15 and 20 steps on-policy's 50 steps ended at
held-out 0.000 (from 15: 2 successes in 6,400 samples at temperature 1): nothing is learned, so no
lag can cost. From 40, 5 seeds of on-policy ended at a median 0.052, below the start, and no
condition could be ranked (lr 1e-3 there collapsed to 0.000; sampling at temperature 0.7 reached
0.124). From 60, on-policy's 5 seeds reached a median 0.180 (0.11 to 0.41) and η = 4 at depth 5
0.064 (all 5 at or below 0.142): slow, noisy, but it ranks (BENCHMARKS.md, Session 23)."""


def ensure_hard_start(size: str, sft_steps: int) -> Path:
    """The model SFT'd for ``sft_steps`` steps (recipes/demo_sft.yaml's batch and lr) from the
    same untrained model as :func:`ensure_start`'s (built if missing)."""
    from asyncrl import launch
    from tools.bench.vs_trl import MID_MODEL
    from tools.make_demo import make_demo
    from tools.make_tiny_model import make_tiny_model

    make_demo(ROOT / "build/demo")  # the demo's data and untrained model
    name = f"{size}_sft_hard{sft_steps}"
    sft = OUT / name
    if not (sft / "hf/latest/config.json").is_file():
        if size == "demo":
            model = ROOT / "build/demo/model"
        else:
            model = OUT / "mid_model"
            if not (model / "config.json").is_file():
                make_tiny_model(model, **MID_MODEL)
        ov = [
            f"model.path={model}",
            f"run.name={name}",
            f"run.output_dir={OUT}",
            f"run.steps={sft_steps}",
            "run.timeout_s=3600",
        ]
        s = launch.run(ROOT / "recipes/demo_sft.yaml", ov, overwrite=True, progress=False)
        if s["outcome"] != "completed":
            raise SystemExit(f"spread: the hard start's SFT did not complete: {s['outcome']}")
    return sft / "hf/latest"


def recipe_overrides(condition: str, i: int, extra: tuple[str, ...] = ()) -> list[str]:
    """The overrides of ``condition``'s run i: its seed, :data:`PINNED` (a hard condition that does
    not set it), its own, then ``--set``'s (the last of one key wins)."""
    spec = CONDITIONS[condition]
    assert spec is not None, f"{condition} is not an asyncrl condition"
    overrides, seeds = spec
    named = {o.split("=")[0] for o in overrides}
    pinned = [p for p in PINNED if condition in HARD and p.split("=")[0] not in named]
    return [f"run.seed={i if seeds else 0}", *pinned, *overrides, *extra]


def run_one(
    condition: str,
    i: int,
    *,
    py: str,
    start: Path,
    steps: int,
    size: str,
    extra: tuple[str, ...] = (),
) -> dict:
    tag = f"spread_{size}_{condition}_{i}"
    spec = CONDITIONS[condition]
    if spec is None:
        r = run_trl(py, start, steps, 1, tag, seed=i)
    else:
        r = run_asyncrl(start, steps, recipe_overrides(condition, i, extra), tag)
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
    p.add_argument(
        "--first-run",
        type=int,
        default=0,
        help="the first run's number (and seed): more seeds added to an earlier bench's",
    )
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--conditions", default="", help=", ".join(CONDITIONS))
    p.add_argument(
        "--start",
        choices=["sft", "hard"],
        default="sft",
        help="sft: the vs_trl start; hard: SFT'd --sft-steps only, held-out near 0 (issue #53)",
    )
    p.add_argument("--sft-steps", type=int, default=HARD_SFT_STEPS, help="--start hard's SFT")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe override for every asyncrl condition (e.g. learner.lr=1e-3); repeatable",
    )
    p.add_argument(
        "--label",
        default="",
        help="a word in every run's name, so that a variant's runs (--set) keep their own folders",
    )
    a = p.parse_args(argv)
    bad = [kv for kv in a.set if "=" not in kv]
    if bad:
        p.error(f"--set: expected KEY=VALUE, got {bad[0]!r}")
    if a.label and not a.label.replace("-", "").replace(".", "").isalnum():
        p.error(f"--label: letters, digits, '-' and '.' only, got {a.label!r}")
    default = HARD_DEFAULT if a.start == "hard" else DEFAULT
    conditions = [c for c in (a.conditions or ",".join(default)).split(",") if c]
    unknown = sorted(set(conditions) - set(CONDITIONS))
    if unknown:
        p.error(f"--conditions: unknown {', '.join(unknown)} (choose from {', '.join(CONDITIONS)})")
    if a.sft_steps < 1:
        p.error(f"--sft-steps: must be at least 1, got {a.sft_steps}")
    py = ensure_trl_env() if any(CONDITIONS[c] is None for c in conditions) else ""
    OUT.mkdir(parents=True, exist_ok=True)
    if a.start == "hard":
        start = ensure_hard_start(a.size, a.sft_steps)
        at_start = heldout(start, OUT / f"hard_start_{a.size}_{a.sft_steps}_eval.log")
        print(f"hard start ({a.sft_steps} SFT steps): held-out {_f(at_start, '.3f')}", flush=True)
    else:
        start = ensure_start(a.size)
    results: dict[str, list[dict]] = {c: [] for c in conditions}
    for i in range(a.first_run, a.first_run + a.runs):
        for c in conditions:
            r = run_one(
                c,
                i,
                py=py,
                start=start,
                steps=a.steps,
                size=(a.size if a.start == "sft" else f"{a.size}_hard")
                + (f"_{a.label}" if a.label else ""),
                extra=tuple(a.set),
            )
            results[c].append(r)
            print(
                f"{c:20} run {i}: held-out {_f(r['heldout'], '.3f')}  batch reward (last 5) "
                f"{_f(r['reward_last'], '.3f')}  wall {r['wall']:.1f} s",
                flush=True,
            )
    summary = {}
    print(f"\n{'condition':20}{'median':>8}{'range':>8}{'std':>8}{'wall':>8}  held-out values")
    for c in conditions:
        held = [r["heldout"] for r in results[c] if r["heldout"] is not None]
        d = describe(held) if held else {"values": [], "median": None, "range": None, "std": None}
        last = [r["reward_last"] for r in results[c] if r["reward_last"] is not None]
        d["reward_last_median"] = statistics.median(last) if last else None
        d["wall_median"] = statistics.median(r["wall"] for r in results[c])
        summary[c] = d
        print(
            f"{c:20}{_f(d['median'], '8.3f')}{_f(d['range'], '8.3f')}{_f(d['std'], '8.3f')}"
            f"{d['wall_median']:8.1f}  {d['values']}"
        )
    out = {"bench": "spread", "size": a.size, "start": a.start, "runs": a.runs}
    if a.start == "hard":
        out |= {"sft_steps": a.sft_steps, "heldout_start": at_start}
    if a.set:
        out |= {"set": a.set}
    print(json.dumps(out | {"conditions": summary}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
