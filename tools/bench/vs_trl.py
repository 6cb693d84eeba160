"""asyncrl against TRL's synchronous ``GRPOTrainer``: the same RL job on this machine's CPUs, timed.

Both sides start from the same SFT'd tiny Qwen3 (the demo's: ``recipes/demo_sft.yaml``; ``--size
mid``: ~9.5M parameters, SFT'd the same way), train on the demo's prompts with the same reward
(asyncrl's ``exact_match``, which TRL's side loads from ``asyncrl/tasks.py``), 16 prompts x 8 samples
per optimizer step, lr 3e-4, grad clip 1.0, no KL, temperature 1, 8 new tokens, constant lr, float32,
one torch thread per process (asyncrl's learner, rollout worker and engine are processes of their
own, so it can keep both of a 2-core machine's cores busy; ``--trl-threads 2`` lets TRL's one process
use two), for the same number of steps. asyncrl runs ``recipes/demo.yaml`` (its
algorithm: decoupled PPO, eta = 4) with ``buffer.dynamic_sampling=false`` so that each step trains
16 x 8 samples as TRL's does, without held-out evaluations during the run (``run.eval_prompts=0``;
TRL evaluates none either) and without W&B (``logging.wandb=false``: TRL's side has
``report_to="none"``; each side writes its metrics to a jsonl file all the same). TRL runs
tools/bench/trl_grpo.py in its own venv (tools/bench/trl_env.sh, built once and cached outside the
repository). Afterwards both final models are scored by
``python -m asyncrl.evaluate`` on the same held-out prompts (greedy).

Per run: wall seconds of the whole process measured from outside (spawn to exit: start-up, model
load, training, saving; and its two ends, spawn to the first step's log and the last step's to exit),
held-out evaluation seconds inside asyncrl's run (taken off its wall; 0 with ``run.eval_prompts=0``),
the training loop's seconds (first logged step to the last, both sides; TRL's ``trainer.train()``
too), and the seconds from spawn until the running mean of the batch reward over
``--window`` steps first reaches ``--target``. The sides alternate (TRL first in even pairs, asyncrl
first in odd ones) so that load from elsewhere hits both. Prints each pair and the medians, draws batch
reward against seconds since spawn (runs/bench_vs_trl/SIZE_reward_vs_wall.png); the last line is JSON:

    {"bench": "vs_trl", "size": ..., "ratio_wall": ..., "reward_trl": ..., "reward_asyncrl": ...}

``ratio_wall`` is median(asyncrl wall - its evaluation) / median(TRL wall): below 1, asyncrl is faster.

    python tools/bench/vs_trl.py [--size demo|mid] [--pairs 3] [--steps 60] [--target 0.6]
        [--window 5] [--trl-threads 1] [key=value ...]    # overrides for asyncrl's recipe only

Builds the demo model, data and SFT checkpoint first if `make demo` has not, and TRL's venv.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from asyncrl import metric_names as names  # noqa: E402
from asyncrl import plots  # noqa: E402

OUT = ROOT / "runs" / "bench_vs_trl"
RECIPE = ROOT / "recipes" / "demo.yaml"
DATA = ROOT / "build" / "demo" / "data"
MID_MODEL = dict(
    arch="qwen3",
    hidden=384,
    layers=4,
    heads=6,
    kv_heads=6,
    intermediate=1536,
    max_positions=64,
    tie_embeddings=True,
)
"""``--size mid``: the demo's shape (kv heads = heads, tied, char vocabulary), ~9.5M parameters."""
MID_SFT_STEPS = 250
"""SFT steps of the mid model (recipes/demo_sft.yaml's batch and lr): ~0.3 held-out success."""
EVAL_LINE = re.compile(r"held-out success \S+ at version \d+ \(.*?, ([0-9.]+) s\)")


def ensure_trl_env() -> str:
    """TRL's python (tools/bench/trl_env.sh builds its venv once, then finds it cached)."""
    r = subprocess.run(
        ["bash", str(ROOT / "tools/bench/trl_env.sh")], stdout=subprocess.PIPE, text=True
    )
    if r.returncode != 0:
        raise SystemExit("vs_trl: tools/bench/trl_env.sh failed (its lines above say why)")
    return r.stdout.strip().splitlines()[-1]


def ensure_start(size: str) -> Path:
    """The SFT'd model both sides start from (built if missing)."""
    from tools.bench.async_vs_sync import ensure_sft

    ensure_sft()
    if size == "demo":
        return ROOT / "runs/demo_sft/hf/latest"
    from asyncrl import launch
    from tools.make_tiny_model import make_tiny_model

    sft = OUT / "mid_sft"
    if not (sft / "hf/latest/config.json").is_file():
        model = OUT / "mid_model"
        if not (model / "config.json").is_file():
            make_tiny_model(model, **MID_MODEL)
        ov = [
            f"model.path={model}",
            "run.name=mid_sft",
            f"run.output_dir={OUT}",
            f"run.steps={MID_SFT_STEPS}",
            "run.timeout_s=3600",
        ]
        s = launch.run(ROOT / "recipes/demo_sft.yaml", ov, overwrite=True, progress=False)
        if s["outcome"] != "completed":
            raise SystemExit(f"vs_trl: the mid model's SFT did not complete: {s['outcome']}")
        print(f"mid model SFT: held-out success {s['reward_start']} -> {s['reward_end']}")
    return sft / "hf/latest"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, **extra}


def _spawn(cmd: list[str], env: dict[str, str], log: Path) -> tuple[float, float, int]:
    """Run ``cmd`` to its end; (Unix time of the spawn, wall seconds, exit code)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        t_spawn, t0 = time.time(), time.monotonic()
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
        return t_spawn, time.monotonic() - t0, rc


def running_mean(ys: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values (fewer at the start) at each point."""
    out = []
    for i in range(len(ys)):
        w = ys[max(0, i + 1 - window) : i + 1]
        out.append(sum(w) / len(w))
    return out


def time_to(ts: list[float], ys: list[float], target: float, window: int) -> float | None:
    """Seconds (``ts`` are since the spawn) at the first step whose running mean over ``window``
    steps reaches ``target``; None if it never does. The first window - 1 steps do not count: a
    mean of fewer steps is noise."""
    for i, m in enumerate(running_mean(ys, window)):
        if i + 1 >= window and m >= target:
            return ts[i]
    return None


def heldout(model: Path, log: Path) -> float | None:
    """``python -m asyncrl.evaluate`` on the demo's held-out prompts: greedy success of ``model``."""
    cmd = [sys.executable, "-m", "asyncrl.evaluate", str(RECIPE), f"model.path={model}"]
    cmd += ["--model", str(model)]  # model.path: its tokenizer too
    r = subprocess.run(
        cmd, env=_env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"), capture_output=True, text=True
    )
    log.write_text(r.stderr)
    if r.returncode != 0:
        print(f"vs_trl: evaluating {model} failed: {r.stderr.strip()[-500:]}", file=sys.stderr)
        return None
    return float(json.loads(r.stdout.strip().splitlines()[-1])["score"])


def run_trl(py: str, start: Path, steps: int, threads: int, tag: str, seed: int = 0) -> dict:
    out = OUT / tag
    cmd = [py, str(ROOT / "tools/bench/trl_grpo.py"), "--model", str(start)]
    cmd += ["--train", str(DATA / "train.jsonl"), "--out", str(out), "--steps", str(steps)]
    cmd += ["--threads", str(threads), "--seed", str(seed)]
    t_spawn, wall, rc = _spawn(cmd, _env(OMP_NUM_THREADS=str(threads)), out / "stdout.log")
    if rc != 0:
        raise SystemExit(f"vs_trl: TRL's run failed (exit {rc}): see {out / 'stdout.log'}")
    res = json.loads((out / "result.json").read_text())
    recs = [r for r in plots.read_metrics(out / "log.jsonl") if "reward" in r]
    ts = [r["time"] - t_spawn for r in recs]
    return {
        "side": "trl",
        "steps": res["steps"],
        "wall": wall,
        "eval_s": 0.0,
        "wall_minus_eval": wall,
        "loop_s": ts[-1] - ts[0] if len(ts) > 1 else None,
        "train_call_s": res["train_seconds"],
        "t": ts,
        "reward": [float(r["reward"]) for r in recs],
        "model": out / "model",
    }


def run_asyncrl(start: Path, steps: int, overrides: list[str], tag: str) -> dict:
    ov = [
        f"run.name={tag}",
        f"run.output_dir={OUT}",
        f"run.steps={steps}",
        "run.eval_prompts=0",  # TRL evaluates nothing while it trains; both are scored afterwards
        "run.timeout_s=3600",
        "buffer.dynamic_sampling=false",  # every step trains 16 x 8 samples, as TRL's
        "learner.checkpoint_every=0",
        "logging.wandb=false",  # TRL's side reports to none; both write their metrics as jsonl
        f"model.path={start}",
        *overrides,
    ]
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", str(RECIPE), "--overwrite", "--no-progress"]
    run_dir = OUT / tag
    env = _env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    t_spawn, wall, rc = _spawn([*cmd, *ov], env, OUT / f"{tag}.log")
    summary = json.loads((run_dir / "summary.json").read_text()) if rc == 0 else {}
    if rc != 0 or summary.get("outcome") != "completed":
        raise SystemExit(f"vs_trl: asyncrl's run failed (exit {rc}): see {OUT / f'{tag}.log'}")
    learner_log = run_dir / "logs/learner.log"
    text = learner_log.read_text() if learner_log.is_file() else ""
    eval_s = sum(float(m.group(1)) for m in EVAL_LINE.finditer(text))
    records = plots.read_metrics(run_dir / "metrics.jsonl")
    learner = [
        r
        for r in records
        if r.get("process") == "learner" and isinstance(r.get(names.BATCH_REWARD_MEAN), int | float)
    ]
    by_step = {r["step"]: r for r in learner}  # a resumed learner logs a version again: the last
    recs = [by_step[s] for s in sorted(by_step)]
    return {
        "side": "asyncrl",
        "steps": summary["steps"],
        "wall": wall,
        "eval_s": eval_s,
        "wall_minus_eval": wall - eval_s,
        "loop_s": summary.get("train_seconds"),
        "train_call_s": None,
        "t": [r["time"] - t_spawn for r in recs],
        "reward": [r[names.BATCH_REWARD_MEAN] for r in recs],
        "model": run_dir / "hf/latest",
    }


def _f(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


ROWS = [
    ("wall s (spawn to exit)", "wall", ".1f"),
    ("  spawn to 1st step s", "start_s", ".1f"),
    ("  last step to exit s", "end_s", ".1f"),
    ("held-out eval s in run", "eval_s", ".1f"),
    ("wall s minus eval", "wall_minus_eval", ".1f"),
    ("loop s (1st to last step)", "loop_s", ".1f"),
    ("trainer.train() s", "train_call_s", ".1f"),
    ("s to target (from spawn)", "to_target", ".1f"),
    ("batch reward, last window", "reward_last", ".3f"),
    ("held-out success, end", "heldout", ".3f"),
]


def _table(title: str, trl: dict, asy: dict) -> None:
    print(f"{title:28}{'TRL':>12}{'asyncrl':>12}")
    for label, key, spec in ROWS:
        print(f"{label:28}{_f(trl.get(key), spec):>12}{_f(asy.get(key), spec):>12}")


def plot(runs: list[dict], size: str, target: float, window: int) -> Path:
    plt = plots._plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    color = {"trl": "C1", "asyncrl": "C0"}
    seen = set()
    for r in runs:
        c = color[r["side"]]
        ax.plot(r["t"], r["reward"], ".", ms=3, color=c, alpha=0.5)
        label = None if r["side"] in seen else f"{r['side']}: batch reward, {window}-step mean"
        seen.add(r["side"])
        mean = running_mean(r["reward"], window)
        ax.plot(r["t"], mean, "-", color=c, label=label)
        if mean:  # the process's exit: what saving and shutting down cost after the last step
            ax.plot([r["t"][-1], r["wall"]], [mean[-1]] * 2, ":", color=c)
            ax.plot([r["wall"]], [mean[-1]], "|", ms=12, mew=2, color=c)
    ax.axhline(target, ls="--", color="0.5", lw=1, label=f"target {target}; |: process exit")
    ax.set(
        xlabel="seconds since the process was spawned",
        ylabel="batch mean reward",
        title=f"asyncrl vs TRL GRPOTrainer ({size}): reward against wall clock",
        ylim=(-0.02, 1.02),
    )
    ax.legend(loc="lower right", fontsize="small")
    return plots._save(fig, OUT / f"{size}_reward_vs_wall.png")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=["demo", "mid"], default="demo")
    p.add_argument("--pairs", type=int, default=3, help="TRL + asyncrl runs, alternating order")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps of each run")
    p.add_argument(
        "--target",
        type=float,
        default=0.6,
        help="batch reward to time (the demo's sampled batches end at ~0.7-0.75 after 60 steps)",
    )
    p.add_argument("--window", type=int, default=5, help="steps in the reward's running mean")
    p.add_argument("--trl-threads", type=int, default=1, help="torch threads of TRL's process")
    p.add_argument("overrides", nargs="*", help="recipe overrides for asyncrl's runs")
    a = p.parse_args(argv)
    py = ensure_trl_env()
    start = ensure_start(a.size)
    OUT.mkdir(parents=True, exist_ok=True)
    reward_start = heldout(start, OUT / f"{a.size}_eval_start.log")
    print(f"start model {start}: held-out success {_f(reward_start, '.3f')}")
    load0 = os.getloadavg()[0]
    runs: list[dict] = []
    pairs: list[tuple[dict, dict]] = []
    for i in range(a.pairs):
        done = {}
        for side in ("trl", "asyncrl") if i % 2 == 0 else ("asyncrl", "trl"):
            tag = f"{a.size}_{side}_{i}"
            if side == "trl":
                r = run_trl(py, start, a.steps, a.trl_threads, tag)
            else:
                r = run_asyncrl(start, a.steps, a.overrides, tag)
            r["start_s"] = r["t"][0] if r["t"] else None
            r["end_s"] = r["wall"] - r["t"][-1] if r["t"] else None
            r["to_target"] = time_to(r["t"], r["reward"], a.target, a.window)
            r["reward_last"] = running_mean(r["reward"], a.window)[-1] if r["reward"] else None
            r["heldout"] = heldout(r["model"], OUT / f"{tag}_eval.log")
            done[side] = r
            runs.append(r)
        pairs.append((done["trl"], done["asyncrl"]))
        trl, asy = pairs[-1]
        _table(f"pair {i} ({'TRL' if i % 2 == 0 else 'asyncrl'} first)", trl, asy)
        ratio = asy["wall_minus_eval"] / trl["wall"]
        print(f"{'ratio asyncrl/TRL wall':28}{ratio:>24.2f}\n")
    load1 = os.getloadavg()[0]
    med = {
        side: {key: _median([pr[j][key] for pr in pairs]) for _, key, _ in ROWS}
        for j, side in enumerate(("trl", "asyncrl"))
    }
    _table(f"median of {a.pairs} pair(s)", med["trl"], med["asyncrl"])
    ratio_wall = med["asyncrl"]["wall_minus_eval"] / med["trl"]["wall"]
    print(f"{'ratio asyncrl/TRL wall':28}{ratio_wall:>24.2f}")
    print(f"load average (1 min) at start {load0:.1f}, at end {load1:.1f}; cores {os.cpu_count()}")
    print(f"plot: {plot(runs, a.size, a.target, a.window)}")
    print(
        json.dumps(
            {
                "bench": "vs_trl",
                "size": a.size,
                "pairs": a.pairs,
                "steps": a.steps,
                "ratio_wall": ratio_wall,
                "wall_trl": med["trl"]["wall"],
                "wall_asyncrl_minus_eval": med["asyncrl"]["wall_minus_eval"],
                "loop_trl": med["trl"]["loop_s"],
                "loop_asyncrl": med["asyncrl"]["loop_s"],
                "target": a.target,
                "to_target_trl": med["trl"]["to_target"],
                "to_target_asyncrl": med["asyncrl"]["to_target"],
                "reward_start": reward_start,
                "reward_trl": med["trl"]["heldout"],
                "reward_asyncrl": med["asyncrl"]["heldout"],
                "trl_threads": a.trl_threads,
                "load_avg": [round(load0, 1), round(load1, 1)],
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
