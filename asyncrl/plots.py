"""metrics.jsonl -> PNG plots of a run (matplotlib, Agg backend: no display needed).

    python tools/plots.py runs/demo/metrics.jsonl [--out runs/demo/plots]   (or: python -m asyncrl.plots)

Writes (each only if its metrics are present; a missing key never fails the tool):
- ``reward.png``: the trained batch's mean reward at every step (a line), the worker's sampled means
  and held-out success at each evaluation (points); below, the mean response length;
- ``staleness.png``: the staleness histogram over versions (heat map) with per-batch mean and max,
  the bound eta, and groups dropped as stale;
- ``throughput.png``: generated and trained tokens/s, learner and generator idle fractions;
- ``weight_sync.png``: weight-sync seconds and generator pause seconds per version;
- ``drift.png``: KL(mu || pi_prox) per staleness bucket (engine mismatch vs staleness drift);
- ``by_staleness.png``: are old samples teaching? Per staleness k = 0..eta, one line each, over the
  versions: the tokens trained, their KL to the learner, their importance weights' ESS, the
  fraction masked or clipped, the mean |A| and the batch reward of the groups of that staleness;
- ``learning.png``: loss, entropy, grad norm.

Each line of metrics.jsonl is one JSON object of flat ``section/name`` keys; the x axis is the
record's ``version`` (or ``step``), else its position. The keys read are asyncrl's own, by name
(:mod:`asyncrl.metric_names`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from asyncrl import metric_names as names

X_KEYS = ("version", "step", "learner/version", "_step")


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics JSONL file; malformed lines (a crash mid-write) are skipped."""
    records = []
    with Path(path).open() as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                records.append(_flatten(rec))
    return records


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and not _is_hist(v):
            out.update(_flatten(v, key + "/"))
        else:
            out[key] = v
    return out


def _is_hist(v) -> bool:
    """A histogram as asyncrl.metrics logs it: ``{"hist": counts, "edges": edges}``."""
    return (
        isinstance(v, dict) and isinstance(v.get("hist"), list) and isinstance(v.get("edges"), list)
    )


def _num(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


def _x(rec: dict, i: int) -> float:
    for k in X_KEYS:
        v = _num(rec.get(k))
        if v is not None:
            return v
    return float(i)


def series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(xs, ys) of ``key`` in the records that hold a number under it."""
    xs, ys = [], []
    for i, r in enumerate(records):
        v = _num(r.get(key))
        if v is not None:
            xs.append(_x(r, i))
            ys.append(v)
    return xs, ys


def family(records: list[dict], prefix: str) -> list[str]:
    """The keys of a family (``prefix`` + bucket) that hold a number somewhere, sorted."""
    keys = {
        k for r in records for k, v in r.items() if k.startswith(prefix) and _num(v) is not None
    }
    return sorted(keys, key=lambda k: (not k[len(prefix) :].isdigit(), _bucket(k, prefix), k))


def _bucket(key: str, prefix: str) -> int:
    tail = key[len(prefix) :]
    return int(tail) if tail.isdigit() else -1


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _line(ax, records, key, label=None, **kw) -> bool:
    xs, ys = series(records, key)
    if xs:
        ax.plot(xs, ys, label=label or key, **kw)
    return bool(xs)


def per_version(xs: list[float], ys: list[float]) -> tuple[list[float], list[float]]:
    """One value per x, the last logged, in x order: a line through them never goes back or up and
    down at one x (a resumed learner logs again the versions its crash lost)."""
    last = dict(zip(xs, ys, strict=True))
    order = sorted(last)
    return order, [last[x] for x in order]


def _per_step_and_sampled(ax, records, batch_key: str, worker_key: str, label: str) -> bool:
    """The learner's ``batch_key``, one point per step joined as a line, and the worker's
    ``worker_key``, a mean over each metrics interval (10 s) at the version it had reached, as dots
    of their own: several can share a version and none stands for a version between them."""
    xs, ys = per_version(*series(records, batch_key))
    if xs:
        ax.plot(xs, ys, "-", color="C0", label=f"{label}: trained batch, every step")
    wx, wy = series(records, worker_key)
    if wx:
        ax.plot(
            wx, wy, ".", ls="none", color="0.55", label=f"{label}: sampled (worker, 10 s means)"
        )
    return bool(xs or wx)


def _evaluations(ax, records, label: str, color: str = "C3") -> bool:
    """Held-out evaluations as markers alone: they are versions apart, and a line between two
    would read as a curve that was never measured."""
    xs, ys = per_version(*series(records, names.EVAL_SUCCESS))
    if xs:
        ax.plot(xs, ys, "o", ls="none", ms=7, color=color, label=label, zorder=3)
    return bool(xs)


def reward_figure(records):
    """reward.png's figure (None without a reward): the trained batch's mean reward at every step,
    the worker's sampled means and the held-out evaluations; below, the response length."""
    plt = _plt()
    lengths = (
        series(records, names.BATCH_RESPONSE_LENGTH_MEAN)[0]
        or series(records, names.RESPONSE_LENGTH_MEAN)[0]
    )
    fig, axes = plt.subplots(2 if lengths else 1, 1, figsize=(7, 6 if lengths else 4), sharex=True)
    ax = axes[0] if lengths else axes
    drawn = _per_step_and_sampled(
        ax, records, names.BATCH_REWARD_MEAN, names.REWARD_MEAN, "train reward"
    )
    drawn |= _evaluations(ax, records, "held-out success (greedy)")
    if not drawn:
        plt.close(fig)
        return None
    ax.set(ylabel="reward", title="Reward")
    if all(0 <= y <= 1 for line in ax.get_lines() for y in line.get_ydata()):
        ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="lower right", fontsize="small")
    if lengths:
        ax = axes[1]
        _per_step_and_sampled(
            ax, records, names.BATCH_RESPONSE_LENGTH_MEAN, names.RESPONSE_LENGTH_MEAN, "length"
        )
        ax.set(ylabel="response tokens")
        ax.legend(loc="best", fontsize="small")
    ax.set_xlabel("policy version")
    return fig


def plot_reward(records, out: Path) -> Path | None:
    fig = reward_figure(records)
    return None if fig is None else _save(fig, out / "reward.png")


def plot_reward_model(records, out: Path) -> Path | None:
    """The reward model's score against the true reward, per policy version: the training samples'
    mean reward (the model's score when ``rollout.reward: model``; left axis, in the model's units)
    and held-out exact match against the ground truth (``rollout.eval_reward``; right axis). A score
    that rises while the true reward does not is the reward model being gamed. Drawn by `asyncrl
    run` for runs that score with a reward model (reward_model.png)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    right = ax.twinx()
    drawn = _per_step_and_sampled(
        ax, records, names.BATCH_REWARD_MEAN, names.REWARD_MEAN, "reward model score"
    )
    drawn |= _evaluations(right, records, "held-out exact match (ground truth, greedy)")
    if not drawn:
        plt.close(fig)
        return None
    ax.set(
        xlabel="policy version", ylabel="reward model score", title="Reward model vs true reward"
    )
    right.set(ylabel="held-out exact match", ylim=(-0.02, 1.02))
    lines = ax.get_lines() + right.get_lines()
    ax.legend(lines, [ln.get_label() for ln in lines], loc="lower right", fontsize="small")
    return _save(fig, out / "reward_model.png")


def plot_staleness(records, out: Path) -> Path | None:
    plt = _plt()
    hist = names.STALENESS_HIST
    cols: list[tuple[float, dict[int, float]]] = []  # (x, bucket -> groups) per record
    for i, r in enumerate(records):
        col: dict[int, float] = {}
        for k, v in r.items():
            if k.startswith(hist) and k[len(hist) :].isdigit() and _num(v) is not None:
                col[int(k[len(hist) :])] = float(v)
        if col:
            cols.append((_x(r, i), col))
    buckets = sorted({b for _, col in cols for b in col})
    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = False
    if buckets:
        grid = [[col.get(b, 0.0) for _, col in cols] for b in range(max(buckets) + 1)]
        xs = [x for x, _ in cols]
        x0, x1 = (min(xs), max(xs)) if xs else (0, 1)
        im = ax.imshow(
            grid,
            aspect="auto",
            origin="lower",
            interpolation="nearest",
            extent=(x0 - 0.5, x1 + 0.5, -0.5, max(buckets) + 0.5),
            cmap="Blues",
        )
        fig.colorbar(im, ax=ax, label="groups")
        drawn = True
    drawn |= _line(ax, records, names.STALENESS_MEAN, label="mean", color="C1")
    drawn |= _line(
        ax, records, names.STALENESS_MAX, label="max", color="C3", drawstyle="steps-post"
    )
    _, ys = series(records, names.STALENESS_BOUND)
    if ys:
        ax.axhline(max(ys), ls="--", color="k", label=f"bound eta = {max(ys):g}")
    if not drawn:
        plt.close(fig)
        return None
    ax.set(xlabel="policy version", ylabel="staleness (versions)", title="Staleness")
    ax.legend(loc="upper left")
    return _save(fig, out / "staleness.png")


def learner_idle_series(records: list[dict]) -> tuple[list[float], list[float]]:
    """Learner idle fraction per step, from its step records: (seconds waiting for the batch) /
    (wall seconds since the previous step)."""
    learner = [r for r in records if r.get("process") == "learner" and _num(r.get("time"))]
    xs, ys = [], []
    prev = None
    for i, r in enumerate(learner):
        wait = _num(r.get(names.BATCH_WAIT_S))
        if wait is None:
            continue
        if prev is not None and r["time"] > prev:
            xs.append(_x(r, i))
            ys.append(min(1.0, wait / (r["time"] - prev)))
        prev = r["time"]
    return xs, ys


def plot_throughput(records, out: Path) -> Path | None:
    plt = _plt()
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    d1 = _line(a1, records, names.GENERATED_TOKENS_PER_S, label="generated tokens/s")
    d1 |= _line(a1, records, names.TRAINED_TOKENS_PER_S, label="trained tokens/s")
    xs, ys = learner_idle_series(records)
    if xs:
        a2.plot(xs, ys, label="learner idle (waiting for data)")
    d2 = bool(xs)
    d2 |= _line(a2, records, names.GENERATOR_IDLE, label="generator idle")
    if not (d1 or d2):
        plt.close(fig)
        return None
    a1.set(ylabel="tokens/s", title="Throughput")
    a2.set(xlabel="policy version", ylabel="idle fraction", ylim=(-0.02, 1.02))
    for a, d in ((a1, d1), (a2, d2)):
        if d:
            a.legend(loc="best")
    return _save(fig, out / "throughput.png")


def plot_weight_sync(records, out: Path) -> Path | None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = _line(ax, records, names.WEIGHT_SYNC_S, label="weight sync (learner)", marker=".")
    for k in family(records, names.PAUSE_S)[:8]:
        drawn |= _line(ax, records, k, label=f"pause {k[len(names.PAUSE_S) :]}", marker=".")
    if not drawn:
        plt.close(fig)
        return None
    ax.set(xlabel="policy version", ylabel="seconds", title="Weight sync and generator pause")
    ax.legend(loc="best")
    return _save(fig, out / "weight_sync.png")


def plot_drift(records, out: Path) -> Path | None:
    plt = _plt()
    keys = [k for k in (names.DRIFT_MISMATCH, names.DRIFT_KV_MIXED) if series(records, k)[0]]
    keys += family(records, names.DRIFT_BY_STALENESS)
    if not keys:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for k in keys:
        label = {
            "drift/mismatch_kl": "staleness 0 (engine mismatch)",
            "drift/kv_mixed_kl": "staleness 0, across an update (KV of older weights)",
        }.get(k, k.split("/", 1)[1])
        _line(ax, records, k, label=label)
    ax.set(xlabel="policy version", ylabel="KL(mu || pi_prox)", title="Drift by staleness")
    ax.legend(loc="best")
    return _save(fig, out / "drift.png")


STALENESS_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("trained tokens", (names.STALENESS_TOKENS,)),
    ("KL(mu || pi_prox)", (names.DRIFT_BY_STALENESS,)),  # k = 0: names.DRIFT_MISMATCH
    ("ESS of pi_prox/mu", (names.STALENESS_ESS,)),
    ("masked or clipped", (names.STALENESS_MASKED, names.STALENESS_CLIPPED)),  # their sum
    ("mean |A|", (names.STALENESS_ADV_ABS,)),
    ("batch reward", (names.STALENESS_REWARD,)),
)
"""by_staleness.png's panels: a label and the families whose bucket-k values, summed, make line k
(a token is either masked, or kept and maybe clipped: the two fractions add up)."""


def staleness_series(records, prefixes: tuple[str, ...], k: int) -> tuple[list, list]:
    """(xs, ys) of line k of a :data:`STALENESS_PANELS` panel: the records holding every family's
    bucket k, their values summed, one per version (the last logged). The drift's KL has no bucket
    0 of its own: at staleness 0 it is the engine mismatch."""
    keys = [
        names.DRIFT_MISMATCH if (p == names.DRIFT_BY_STALENESS and k == 0) else f"{p}{k}"
        for p in prefixes
    ]
    xs, ys = [], []
    for i, r in enumerate(records):
        vals = [_num(r.get(key)) for key in keys]
        if all(v is not None for v in vals):
            xs.append(_x(r, i))
            ys.append(sum(vals))
    return per_version(xs, ys)


def by_staleness_figure(records):
    """by_staleness.png's figure (None without the staleness view's metrics): one panel per
    quantity, one line per staleness k, fresh dark to stale light; the KL on a log scale."""
    ks = [_bucket(key, names.STALENESS_TOKENS) for key in family(records, names.STALENESS_TOKENS)]
    ks = [k for k in ks if k >= 0]
    if not ks:
        return None
    plt = _plt()
    eta = max(ks)
    colors = plt.get_cmap("viridis")
    n = len(STALENESS_PANELS)
    fig, axes = plt.subplots(n, 1, figsize=(7, 1.9 * n), sharex=True)
    for ax, (label, prefixes) in zip(axes, STALENESS_PANELS, strict=True):
        positive = True
        for k in range(eta + 1):
            xs, ys = staleness_series(records, prefixes, k)
            if xs:
                color = colors(0.85 * k / max(eta, 1))
                ax.plot(xs, ys, "-", lw=1.2, color=color, label=f"k = {k}")
                positive &= all(y > 0 for y in ys)
        ax.set_ylabel(label, fontsize="small")
        if prefixes == (names.DRIFT_BY_STALENESS,) and ax.get_lines() and positive:
            ax.set_yscale("log")
    axes[0].set_title("By staleness k (versions behind the learner): are old samples teaching?")
    axes[0].legend(loc="upper left", fontsize="x-small", ncol=min(eta + 1, 6))
    axes[-1].set_xlabel("policy version")
    return fig


def plot_by_staleness(records, out: Path) -> Path | None:
    fig = by_staleness_figure(records)
    return None if fig is None else _save(fig, out / "by_staleness.png")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _plt().close(fig)
    return path


def plot_learning(records, out: Path) -> Path | None:
    """Loss, entropy and grad norm, one small panel each (the response length is reward.png's);
    a distillation run's per-token reverse KL to its teacher below them."""
    panels = [("loss", names.LOSS), ("entropy", names.ENTROPY), ("grad norm", names.GRAD_NORM)]
    panels.append(("reverse KL to teacher", names.DISTILL_REVERSE_KL))
    present = [(t, key) for t, key in panels if series(records, key)[1]]
    return _panels(records, present, "Learning", out / "learning.png") if present else None


def _panels(records, panels: list[tuple[str, str]], title: str, path: Path) -> Path:
    """One small panel per ``(label, key)``, over the policy version."""
    plt = _plt()
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.2 * len(panels)), sharex=True)
    axes = axes if len(panels) > 1 else [axes]
    for ax, (label, key) in zip(axes, panels, strict=True):
        _line(ax, records, key)
        ax.set_ylabel(label)
    axes[0].set_title(title)
    axes[-1].set_xlabel("policy version")
    return _save(fig, path)


def plot_critic(records, out: Path) -> Path | None:
    """PPO with a critic: its value loss, and how much of the returns' spread its values explain
    (1 perfect, 0 no better than their mean)."""
    panels = [
        ("value loss", names.VALUE_LOSS),
        ("explained variance", names.EXPLAINED_VARIANCE),
        ("value clip fraction", names.VALUE_CLIP_FRAC),
    ]
    if not series(records, names.VALUE_LOSS)[1]:
        return None
    return _panels(records, panels, "Critic", out / "critic.png")


PLOTS = (
    plot_reward,
    plot_staleness,
    plot_throughput,
    plot_weight_sync,
    plot_drift,
    plot_by_staleness,
    plot_learning,
    plot_critic,
)


def make_plots(metrics: str | Path, out: str | Path | None = None) -> list[Path]:
    """Write every plot whose metrics exist; returns the files written."""
    metrics = Path(metrics)
    out = Path(out) if out else metrics.parent / "plots"
    out.mkdir(parents=True, exist_ok=True)
    records = read_metrics(metrics) if metrics.is_file() else []
    return [p for plot in PLOTS if (p := plot(records, out)) is not None]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("metrics", help="metrics.jsonl of a run")
    p.add_argument("--out", help="folder for the PNGs (default: plots/ next to the metrics)")
    a = p.parse_args(argv)
    if not Path(a.metrics).is_file():
        print(f"plots: {a.metrics}: no such file", file=sys.stderr)
        return 2
    for path in make_plots(a.metrics, a.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
