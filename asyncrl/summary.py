"""What a run folder tells people and programs at the end: ``summary.json``, the held-out evaluation
and ``plots/*.png`` (while the learner runs, ``learner.json``: :mod:`asyncrl.learner_info`).

The end of a run is done once, by :func:`finish_run`: the learner calls it when it stops (`asyncrl
learner` alone or under `asyncrl run`), and `asyncrl run` calls it only when the learner could not
(killed, failed, timed out), then adds what only it knows (:func:`amend`: restarts, its outcome).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl import metric_names as names
from asyncrl.learner_info import write_whole
from asyncrl.recipe import Recipe
from asyncrl.recipe.checks import model_config
from asyncrl.recipe.moe_config import MOE_MODEL_TYPES

if TYPE_CHECKING:
    from asyncrl.rollout.held_out_eval import EvalReport

SUMMARY_FILE = "summary.json"


# --------------------------------------------------------------------------------------------------
# Evaluation and summary.json
# --------------------------------------------------------------------------------------------------


def find_export(run_dir: Path) -> Path | None:
    """The learner's newest HF export under ``run_dir/hf`` (asyncrl.weights.exports.latest_export)."""
    from asyncrl.weights.exports import latest_export

    found = latest_export(run_dir / "hf")
    return found[0] if found else None


def link_latest_export(run_dir: Path) -> Path | None:
    """``run_dir/hf/latest`` -> the newest export, so a next stage can name it without its version."""
    export = find_export(run_dir)
    if export is None:
        return None
    link = run_dir / "hf" / "latest"
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(os.path.relpath(export, link.parent), target_is_directory=True)
    return link


def eval_held_out(r: Recipe, model_dir: Path | None, *, run_dir: Path) -> EvalReport | None:
    """Greedy held-out evaluation of ``model_dir`` on a built-in engine of its own (None if there
    is no model or no held-out prompts): for a model no generator of the run evaluated."""
    if model_dir is None:
        return None
    from asyncrl.evaluate import evaluate_model

    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    return evaluate_model(r, model_dir, log_path=logs / "engine-eval.log")


def held_out(run_dir: Path, key: str = names.EVAL_SUCCESS) -> dict[int, float]:
    """version -> ``key`` (``eval/success``, ``eval/tool_call_rate``) of every held-out evaluation
    logged in the run (the last one logged for a version wins)."""
    return {
        int(rec["step"]): float(rec[key])
        for rec in _all_records(run_dir)
        if rec.get("process") == "eval" and isinstance(rec.get(key), int | float)
    }


def summary_version(run_dir: Path) -> int:
    """The last version the learner logged (0 if none)."""
    steps = [
        rec["step"]
        for rec in _all_records(run_dir)
        if rec.get("process") == "learner" and isinstance(rec.get("step"), int)
    ]
    return max(steps, default=0)


def log_eval(run_dir: Path, reports: dict[int, EvalReport | None]) -> None:
    """Held-out evaluations by version, as ``eval/*`` lines of process ``eval`` in metrics.jsonl
    (the reward plot shows ``eval/success`` as points beside the trained batches' mean reward)."""
    from asyncrl.metrics import MetricsSink

    values = {v: rep for v, rep in reports.items() if rep is not None}
    if not values:
        return
    with MetricsSink(run_dir, name="", group="", use_wandb=False, process="eval") as sink:
        for v, rep in sorted(values.items()):
            sink.log(rep.metrics(), step=v)


def _all_records(run_dir: Path) -> list[dict]:
    from asyncrl import plots

    path = run_dir / "metrics.jsonl"
    return plots.read_metrics(path) if path.is_file() else []


def summarize(
    r: Recipe,
    *,
    run_dir: Path,
    wall_seconds: float,
    reward_start: float | None,
    reward_end: float | None,
    status: dict[str, Any] | None,
    outcome: str,
    restarts: dict[str, int] | None = None,
    tool_call_rate_start: float | None = None,
    tool_call_rate_end: float | None = None,
) -> dict[str, Any]:
    """summary.json: what the run did, read from the metrics file and the buffer's last status.
    With tools (``rollout.tools``, or a rate measured), also the held-out tool-call rate at the
    start and the end (:data:`asyncrl.metric_names.EVAL_TOOL_CALL_RATE`)."""
    from asyncrl import plots

    records = _all_records(run_dir)
    _, smax = plots.series(records, names.STALENESS_MAX)
    # the learner logs every version it reaches (step = version); the buffer's last polled status
    # may be a second old when the learner finishes
    learner_steps = [
        rec["step"]
        for rec in records
        if rec.get("process") == "learner" and isinstance(rec.get("step"), int)
    ]
    status_version = status.get("version") if status else None
    cands = learner_steps + ([int(status_version)] if isinstance(status_version, int) else [])
    version = max(cands) if cands else 0
    learner = [rec for rec in records if rec.get("process") == "learner"]
    _, tokens = plots.series(learner, names.TRAINED_TOKENS)
    trained_tokens = float(sum(tokens)) if tokens else None
    _, tps = plots.series(records, names.TRAINED_TOKENS_PER_S)
    _, rm_acc = plots.series(learner, names.RM_EVAL_ACCURACY)  # held-out pairs (reward_model)
    times = [
        rec["time"]
        for rec in records
        if rec.get("process") == "learner" and isinstance(rec.get("time"), int | float)
    ]
    summary = {
        "name": r.run.name,
        "run_dir": str(run_dir),
        "outcome": outcome,
        "steps": int(version),
        "reward_start": reward_start,
        "reward_end": reward_end,
        "reward_gain": None
        if reward_start is None or reward_end is None
        else reward_end - reward_start,
        "max_staleness_seen": max(smax) if smax else None,
        "max_staleness_allowed": r.buffer.max_staleness if r.algorithm.uses_rollouts else None,
        "wall_seconds": None,
        # from the learner's first logged step to its last: steady-state training time of
        # len(times) - 1 steps, without start-up and evaluation
        "train_seconds": round(times[-1] - times[0], 3) if len(times) > 1 else None,
        "train_steps_timed": max(len(times) - 1, 0),
        "trained_tokens": trained_tokens,
        "trained_tokens_per_s": sum(tps) / len(tps) if tps else None,
        "algorithm": r.algorithm.loss,
        "restarts": {},
        "buffer_status": status or {},
    }
    if r.algorithm.loss == "reward_model":  # held-out pairs ranked right, at the last evaluation
        summary["rm_eval_accuracy"] = rm_acc[-1] if rm_acc else None
    if r.algorithm.advantage == "distill" and r.algorithm.uses_rollouts:
        summary |= distill_summary(learner)
    if r.algorithm.uses_rollouts and _is_moe(r):
        summary |= {"routing_replay": r.algorithm.routing_replay} | routing_summary(learner)
    rates = (tool_call_rate_start, tool_call_rate_end)
    if r.rollout.tools or any(x is not None for x in rates):
        summary["tool_call_rate_start"], summary["tool_call_rate_end"] = rates
    return amend(summary, wall_seconds=wall_seconds, restarts=restarts or {})


KL_WINDOW = 5
"""Versions averaged for the reverse KL at a distillation run's start and end (one batch's is
noisy: a few hundred tokens)."""


def distill_summary(learner: list[dict]) -> dict[str, float | None]:
    """A distillation run's per-token reverse KL to its teacher (log μ − log π_teacher over the
    trained tokens), averaged over its first and its last :data:`KL_WINDOW` versions."""
    from asyncrl import plots

    _, kl = plots.per_version(*plots.series(learner, names.DISTILL_REVERSE_KL))
    if not kl:
        return {"distill_reverse_kl_start": None, "distill_reverse_kl_end": None}
    n = min(KL_WINDOW, len(kl))
    return {
        "distill_reverse_kl_start": sum(kl[:n]) / n,
        "distill_reverse_kl_end": sum(kl[-n:]) / n,
    }


def _is_moe(r: Recipe) -> bool:
    """Whether ``model.path``'s config.json names a mixture-of-experts model (docs/moe.md)."""
    cfg = model_config(r)
    return cfg is not None and cfg.get("model_type") in MOE_MODEL_TYPES


def routing_summary(learner: list[dict]) -> dict[str, float | None]:
    """An RL run of an MoE policy: how often the learner's own router chose the generator's experts
    (``learner/routing_agreement``, logged when samples carry routes: the mean over the run, over
    its first and over its last :data:`KL_WINDOW` versions; None without routes), and the mean
    per-version drift KL(μ ‖ π_prox), over all tokens and on staleness-0 tokens (engine mismatch):
    a run with replay against one without shows the drift that replay removes. One value per
    version, as :func:`distill_summary`."""
    from asyncrl import plots

    def mean(key: str, part: slice = slice(None)) -> float | None:
        _, ys = plots.per_version(*plots.series(learner, key))
        ys = ys[part]
        return sum(ys) / len(ys) if ys else None

    return {
        "routing_agreement_mean": mean(names.ROUTING_AGREEMENT),
        "routing_agreement_start": mean(names.ROUTING_AGREEMENT, slice(None, KL_WINDOW)),
        "routing_agreement_end": mean(names.ROUTING_AGREEMENT, slice(-KL_WINDOW, None)),
        "drift_kl_mean": mean(names.DRIFT_KL),
        "mismatch_kl_mean": mean(names.DRIFT_MISMATCH),
    }


def amend(
    summary: dict[str, Any],
    *,
    wall_seconds: float | None = None,
    outcome: str | None = None,
    restarts: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Set what the process that ends the run knows best (the launcher: the whole run's wall time,
    its outcome, the restarts), and what follows from it."""
    if outcome is not None:
        summary["outcome"] = outcome
    if restarts is not None:
        summary["restarts"] = restarts
    if wall_seconds is not None:
        summary["wall_seconds"] = round(wall_seconds, 2)
        tokens = summary.get("trained_tokens")
        if tokens and wall_seconds > 0:
            summary["trained_tokens_per_s"] = tokens / wall_seconds
    return summary


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    path = Path(run_dir) / SUMMARY_FILE
    write_whole(path, json.dumps(summary, indent=2) + "\n")
    return path


def read_summary(run_dir: Path, *, since: float = 0.0) -> dict[str, Any] | None:
    """summary.json if it was written at or after Unix time ``since`` (None otherwise)."""
    path = Path(run_dir) / SUMMARY_FILE
    try:
        if path.stat().st_mtime < since:
            return None
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def finish_run(
    r: Recipe,
    *,
    run_dir: Path,
    outcome: str,
    wall_seconds: float,
    status: dict[str, Any] | None,
    restarts: dict[str, int] | None = None,
) -> dict[str, Any]:
    """The end of a run, done once: ``hf/latest`` (if completed), held-out success of the first
    and (if completed) the last model, summary.json and the plots. Returns the summary."""
    run_dir = Path(run_dir)
    if outcome == "completed":
        link_latest_export(run_dir)
    # the generators evaluated the versions they held (asyncrl.learner.eval_schedule); what they did
    # not (an SFT run, generators gone at the end) is evaluated here on an engine of its own
    scores = held_out(run_dir, names.EVAL_SUCCESS)
    rates = held_out(run_dir, names.EVAL_TOOL_CALL_RATE)
    last = summary_version(run_dir)
    reward_start = reward_end = rate_start = rate_end = None
    if r.algorithm.loss != "reward_model":  # a reward model has no policy to generate with
        reward_start, rate_start = scores.get(0), rates.get(0)
        if reward_start is None:
            start_model = Path(r.resolve(r.model.path)) if r.model.path else None
            report = _eval_or_none(r, start_model, run_dir)
            reward_start, rate_start = _score(report), _rate(report)
            log_eval(run_dir, {0: report})
        if outcome == "completed":
            reward_end, rate_end = scores.get(last), rates.get(last)
            if reward_end is None:
                report = _eval_or_none(r, find_export(run_dir), run_dir)
                reward_end, rate_end = _score(report), _rate(report)
                log_eval(run_dir, {last: report})
    summary = summarize(
        r,
        run_dir=run_dir,
        wall_seconds=wall_seconds,
        reward_start=reward_start,
        reward_end=reward_end,
        status=status,
        outcome=outcome,
        restarts=restarts,
        tool_call_rate_start=rate_start,
        tool_call_rate_end=rate_end,
    )
    from asyncrl import plots

    with contextlib.suppress(Exception):  # plots are a convenience; the summary must be written
        summary["plots"] = [str(p) for p in plots.make_plots(run_dir / "metrics.jsonl")]
    write_summary(run_dir, summary)
    return summary


def _score(report: EvalReport | None) -> float | None:
    return None if report is None else report.score


def _rate(report: EvalReport | None) -> float | None:
    return None if report is None else report.tool_call_rate


def _eval_or_none(r: Recipe, model_dir: Path | None, run_dir: Path) -> EvalReport | None:
    """:func:`eval_held_out`, or None with a one-line reason: a failed evaluation must not cost the
    run its summary."""
    try:
        return eval_held_out(r, model_dir, run_dir=run_dir)
    except Exception as e:
        print(f"held-out evaluation of {model_dir} failed: {e}", file=sys.stderr)
        return None


SUMMARY_LINE_KEYS = (
    "outcome",
    "steps",
    "reward_start",
    "reward_end",
    "max_staleness_seen",
    "max_staleness_allowed",
    "wall_seconds",
    "trained_tokens_per_s",
)
"""The summary's keys a command prints as its last line (one JSON object)."""


def summary_line(summary: dict[str, Any]) -> str:
    line = {k: summary.get(k) for k in SUMMARY_LINE_KEYS}
    if "rm_eval_accuracy" in summary:  # a reward-model run: what its rewards would be
        line["rm_eval_accuracy"] = summary["rm_eval_accuracy"]
    if isinstance(summary.get("reward_model"), dict):  # a run scored by a reward model
        line["rm_eval_accuracy"] = summary["reward_model"].get("eval_accuracy")
    for key in ("tool_call_rate_start", "tool_call_rate_end"):  # a run with tools
        if key in summary:
            line[key] = summary[key]
    for key in ("routing_replay", "routing_agreement_mean"):  # an MoE run with routes
        if key in summary:
            line[key] = summary[key]
    return json.dumps(line)
