"""The run's summary.json at the launcher's end: the learner's own (written at its end, with the
held-out evaluation and the plots), amended with what only the launcher knows (its outcome, the wall
time, the restarts); or, if the learner could not write one (killed, or failed), the same end here
(:func:`asyncrl.summary.finish_run`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl import summary as summary_mod
from asyncrl.launch.children import Child
from asyncrl.learner_info import read_learner_info
from asyncrl.recipe import Recipe


def write_run_summary(
    r: Recipe,
    run_dir: Path,
    *,
    outcome: str,
    t0: float,
    started_at: float,
    status: dict[str, Any] | None,
    children: Sequence[Child],
) -> dict[str, Any]:
    """The summary of a run started at ``t0`` (monotonic) / ``started_at`` (wall clock)."""
    wall = time.monotonic() - t0
    info = read_learner_info(run_dir)
    if info is not None and info.ended_at is not None and info.ended_at >= started_at:
        wall = info.ended_at - started_at  # to the end of training, not of the learner's evaluation
    restarts = {c.name: c.restarts for c in children if c.restarts}
    summary = summary_mod.read_summary(run_dir, since=started_at)  # the learner's, at its end
    if summary is None:  # the learner could not write it (killed, or failed): the same end, here
        return summary_mod.finish_run(
            r,
            run_dir=run_dir,
            outcome=outcome,
            wall_seconds=wall,
            status=status,
            restarts=restarts,
        )
    # the learner's exit 0 is "completed" here; its summary knows whether it was stopped instead
    summary_mod.amend(
        summary,
        wall_seconds=wall,
        restarts=restarts,
        outcome=summary["outcome"] if outcome == "completed" else outcome,
    )
    summary_mod.write_summary(run_dir, summary)
    return summary
