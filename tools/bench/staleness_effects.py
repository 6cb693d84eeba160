"""Where the learning of stale samples goes (issue #53, item 1): the data, the gradient and the
selection effects, from the runs of ``tools/bench/spread.py`` (their metrics.jsonl, nothing rerun).

Three effects can make an asynchronous run learn less per step than an on-policy one:

- **data**: a batch trained at step t was sampled by versions t - k, which succeeded less often,
  so it holds fewer groups with a signal. The reference (on-policy) run gives how much one step
  raises the reward as a function of the reward its batch was sampled at, g(R); the *delay model*
  replays that with each asynchronous step's batch sampled ``staleness_mean`` versions back:
  R(v + 1) = R(v) + g(R(v - s_v)). If the asynchronous policy tracks the model, the lag alone
  explains what it lost; if it falls below, the rest is lost per sample.
- **gradient**: the importance weights of stale tokens carry the batch on a few tokens (ESS per
  staleness k, and what the clip or IS cap cut), so a stale sample teaches less than a fresh one.
- **selection**: with several versions in flight, the groups of one version that reach a batch
  first (small k) may be shorter, easier or luckier than the version's others: R(v, k) - R(v).

The policy at version v is read from the rewards of the samples it drew, wherever they were
trained: ``staleness/reward_mean/k`` at step v + k, weighted by the batch's groups of staleness k.

    python tools/bench/staleness_effects.py --prefix spread_mid_hard \\
        --conditions onpolicy,eta4,eta4-depth2 [--runs-dir runs/bench_vs_trl] [--out DIR]

Prints a table per condition and writes ``staleness_effects.png`` (and .json) to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from asyncrl import metric_names as names  # noqa: E402
from asyncrl.metrics import read_metrics  # noqa: E402


def learner_steps(run_dir: Path) -> list[dict]:
    """The learner's records with a batch reward, one per step (a resumed step: the last)."""
    by_step = {}
    for r in read_metrics(run_dir, process="learner"):
        if isinstance(r.get(names.BATCH_REWARD_MEAN), int | float) and "step" in r:
            by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]


def _ks(r: dict) -> list[int]:
    return sorted(
        int(k[len(names.STALENESS_HIST) :])
        for k in r
        if k.startswith(names.STALENESS_HIST) and k[len(names.STALENESS_HIST) :].isdigit()
    )


def by_version(steps: list[dict]) -> dict[int, dict[int, tuple[float, int]]]:
    """{v: {k: (mean reward, groups)}}: the groups sampled by version v that trained at staleness k.
    A step's version is its step number minus one (the version its batch is trained at)."""
    out: dict[int, dict[int, tuple[float, int]]] = defaultdict(dict)
    for r in steps:
        t = r["step"] - 1
        for k in _ks(r):
            n = r.get(f"{names.STALENESS_HIST}{k}", 0)
            rew = r.get(f"{names.STALENESS_REWARD}{k}")
            if n and isinstance(rew, int | float):
                out[t - k][k] = (float(rew), int(n))
    return out


def version_reward(bv: dict[int, dict[int, tuple[float, int]]]) -> dict[int, float]:
    """R(v): the mean reward of every group version v sampled that was trained."""
    out = {}
    for v, ks in bv.items():
        n = sum(c for _, c in ks.values())
        if n:
            out[v] = sum(r * c for r, c in ks.values()) / n
    return out


def smooth(xs: list[float], w: int = 5) -> list[float]:
    return [statistics.fmean(xs[max(0, i - w + 1) : i + 1]) for i in range(len(xs))]


def gain_curve(ref_rewards: list[float], bins: int = 8) -> list[tuple[float, float]]:
    """g(R): the on-policy step's mean rise of the (smoothed) reward against the reward it was
    sampled at, binned by R; returned as (R, gain) points sorted by R."""
    w = 5
    s = smooth(ref_rewards, w)  # full windows only: a partial one rises by half as much
    pairs = [(s[i], s[i + 1] - s[i]) for i in range(w - 1, len(s) - 1)]
    if not pairs:
        return [(0.0, 0.0)]
    pairs.sort()
    size = max(1, len(pairs) // bins)
    return [
        (statistics.fmean(p[0] for p in chunk), statistics.fmean(p[1] for p in chunk))
        for chunk in (pairs[i : i + size] for i in range(0, len(pairs), size))
    ]


def interp(points: list[tuple[float, float]], x: float) -> float:
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    return points[-1][1]


def delay_model(r0: float, staleness: list[float], g: list[tuple[float, float]]) -> list[float]:
    """R(v) for v = 0..len(staleness): each step's rise is g at the reward of the version its batch
    was sampled at on average (v - s_v, interpolated)."""
    rs = [r0]
    for s in staleness:
        v = len(rs) - 1
        back = max(0.0, v - s)
        lo = int(back)
        frac = back - lo
        r_back = rs[lo] + (rs[min(lo + 1, v)] - rs[lo]) * frac
        rs.append(rs[-1] + interp(g, r_back))
    return rs


def run_facts(run_dir: Path) -> dict:
    steps = learner_steps(run_dir)
    if not steps:
        raise SystemExit(f"staleness_effects: {run_dir}: no learner step with a batch reward")
    bv = by_version(steps)
    ess = [r["loss/ess"] for r in steps if isinstance(r.get("loss/ess"), int | float)]
    wall = steps[-1]["time"] - steps[0]["time"]
    wait = sum(r.get("buffer/wait_s", 0.0) or 0.0 for r in steps[1:])
    per_k: dict[str, dict[int, list[float]]] = {
        m: defaultdict(list)
        for m in (names.STALENESS_ESS, names.STALENESS_CLIPPED, names.STALENESS_MASKED)
    }
    for r in steps:
        for m, d in per_k.items():
            for k in _ks(r):
                x = r.get(f"{m}{k}")
                if isinstance(x, int | float) and r.get(f"{names.STALENESS_TOKENS}{k}"):
                    d[k].append(float(x))
    trained = sum(sum(r.get(f"{names.STALENESS_HIST}{k}", 0) for k in _ks(r)) for r in steps)
    dropped = max((r.get(names.DROPPED_STALE, 0) or 0) for r in steps)
    return {
        "steps": steps,
        "dropped_frac": dropped / (dropped + trained) if dropped + trained else 0.0,
        "reward": [float(r[names.BATCH_REWARD_MEAN]) for r in steps],
        "staleness": [float(r.get(names.STALENESS_MEAN, 0.0)) for r in steps],
        "by_version": bv,
        "version_reward": version_reward(bv),
        "ess_median": statistics.median(ess) if ess else None,
        "ess_min": min(ess) if ess else None,
        "wait_frac": wait / wall if wall > 0 else None,
        "step_s": wall / max(1, len(steps) - 1),
        "per_k": {m: {k: statistics.median(v) for k, v in d.items()} for m, d in per_k.items()},
    }


def selection(bv: dict[int, dict[int, tuple[float, int]]]) -> dict[int, float]:
    """Mean over versions of R(v, k) - R(v), per k: > 0 where the early arrivals did better."""
    diffs: dict[int, list[float]] = defaultdict(list)
    rv = version_reward(bv)
    for v, ks in bv.items():
        if len(ks) > 1:
            for k, (r, _) in ks.items():
                diffs[k].append(r - rv[v])
    return {k: statistics.fmean(d) for k, d in sorted(diffs.items())}


def mean_curve(curves: list[list[float]]) -> list[float]:
    n = min(len(c) for c in curves)
    return [statistics.fmean(c[i] for c in curves) for i in range(n)]


def analyse(runs_dir: Path, prefix: str, conditions: list[str], ref: str) -> dict:
    facts: dict[str, list[dict]] = {}
    for c in conditions:
        dirs = [  # not the runs' logs beside them (NAME_eval.log)
            d
            for d in runs_dir.glob(f"{prefix}_{c}_[0-9]*")
            if d.name.rsplit("_", 1)[-1].isdigit() and (d / "metrics.jsonl").is_file()
        ]
        dirs.sort(key=lambda p: int(p.name.rsplit("_", 1)[-1]))
        if not dirs:
            raise SystemExit(f"staleness_effects: no run of {c!r} under {runs_dir}/{prefix}_{c}_N")
        facts[c] = [run_facts(d) for d in dirs]
    if ref not in facts:
        raise SystemExit(f"staleness_effects: the reference {ref!r} is not among --conditions")
    ref_curve = mean_curve([f["reward"] for f in facts[ref]])
    g = gain_curve(ref_curve)
    out: dict = {"ref": ref, "gain_curve": g, "conditions": {}}
    for c, fs in facts.items():
        vr = mean_curve(
            [
                [f["version_reward"].get(v, float("nan")) for v in range(len(f["reward"]))]
                for f in fs
            ]
        )
        stale = mean_curve([f["staleness"] for f in fs])
        model = delay_model(ref_curve[0], stale, g)[: len(vr)]
        sel: dict[int, list[float]] = defaultdict(list)
        for f in fs:
            for k, d in selection(f["by_version"]).items():
                sel[k].append(d)
        tail = slice(max(0, len(vr) - 10), len(vr) - 4)  # versions whose groups all reached a batch
        vr_tail = [x for x in vr[tail] if x == x]
        out["conditions"][c] = {
            "runs": len(fs),
            "staleness_mean": statistics.fmean(stale),
            "ess_median": statistics.median(
                f["ess_median"] for f in fs if f["ess_median"] is not None
            ),
            "ess_min": min(f["ess_min"] for f in fs if f["ess_min"] is not None),
            "wait_frac": statistics.fmean(f["wait_frac"] for f in fs if f["wait_frac"] is not None),
            "step_s": statistics.fmean(f["step_s"] for f in fs),
            "dropped_frac": statistics.fmean(f["dropped_frac"] for f in fs),
            "batch_reward": mean_curve([f["reward"] for f in fs]),
            "version_reward": vr,
            "delay_model": model,
            "version_reward_tail": statistics.fmean(vr_tail) if vr_tail else None,
            "delay_model_tail": statistics.fmean(model[tail]) if model[tail] else None,
            "ref_tail": statistics.fmean(ref_curve[tail]) if ref_curve[tail] else None,
            "selection": {k: statistics.fmean(d) for k, d in sorted(sel.items())},
            "per_k": {
                m.split("/")[1]: {
                    k: statistics.median(f["per_k"][m][k] for f in fs if k in f["per_k"][m])
                    for k in sorted({k for f in fs for k in f["per_k"][m]})
                }
                for m in (names.STALENESS_ESS, names.STALENESS_CLIPPED, names.STALENESS_MASKED)
            },
        }
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    for i, (c, d) in enumerate(result["conditions"].items()):
        color = f"C{i}"
        ax[0, 0].plot(smooth(d["batch_reward"]), color=color, label=c)
        ax[0, 1].plot(d["version_reward"], color=color, label=f"{c}: sampled by v")
        if c != result["ref"]:
            ax[0, 1].plot(d["delay_model"], color=color, ls="--", label=f"{c}: the lag alone")
        ess = d["per_k"]["ess"]
        ax[1, 0].plot(list(ess), list(ess.values()), "o-", color=color, label=f"{c}: ESS")
        clip = d["per_k"]["clipped_frac"]
        ax[1, 0].plot(list(clip), list(clip.values()), "x:", color=color, label=f"{c}: clipped")
        sel = d["selection"]
        if sel:
            ax[1, 1].plot(list(sel), list(sel.values()), "o-", color=color, label=c)
    ax[0, 0].set(title="batch reward at step t (5-step mean)", xlabel="step")
    ax[0, 1].set(title="R(v): reward of the samples version v drew", xlabel="version v")
    ax[1, 0].set(title="per staleness k: ESS and clipped fraction (median)", xlabel="k")
    ax[1, 1].set(
        title="selection: R(v, k) - R(v)", xlabel="staleness k at which v's groups trained"
    )
    ax[1, 1].axhline(0, color="grey", lw=0.5)
    for a in ax.flat:
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "bench_vs_trl")
    p.add_argument("--prefix", default="spread_mid_hard", help="run folders are PREFIX_COND_I")
    p.add_argument("--conditions", required=True, help="comma-separated, the reference among them")
    p.add_argument("--ref", default="onpolicy", help="the on-policy condition")
    p.add_argument("--out", type=Path, default=None, help="default: --runs-dir")
    a = p.parse_args(argv)
    conditions = [c for c in a.conditions.split(",") if c]
    result = analyse(a.runs_dir, a.prefix, conditions, a.ref)
    out = a.out or a.runs_dir
    out.mkdir(parents=True, exist_ok=True)
    plot(result, out / "staleness_effects.png")
    (out / "staleness_effects.json").write_text(json.dumps(result, indent=1))
    print(
        f"{'condition':16}{'runs':>5}{'stale':>7}{'ESS med':>8}{'ESS min':>8}{'wait':>6}{'step s':>7}"
        f"{'dropped':>8}"
        f"{'R(v) tail':>10}{'lag model':>10}{'ref':>6}  selection R(v,k)-R(v) by k"
    )
    for c, d in result["conditions"].items():
        sel = " ".join(f"{k}:{x:+.3f}" for k, x in d["selection"].items())
        print(
            f"{c:16}{d['runs']:>5}{d['staleness_mean']:7.2f}{d['ess_median']:8.3f}{d['ess_min']:8.3f}"
            f"{d['wait_frac']:6.2f}{d['step_s']:7.2f}{d['dropped_frac']:8.2f}"
            f"{_f(d['version_reward_tail'])}"
            f"{_f(d['delay_model_tail'])}{_f(d['ref_tail'], 6)}  {sel}"
        )
    print(f"plot: {out / 'staleness_effects.png'}")
    return 0


def _f(x: float | None, w: int = 10) -> str:
    return f"{'-':>{w}}" if x is None else f"{x:{w}.3f}"


if __name__ == "__main__":
    raise SystemExit(main())
