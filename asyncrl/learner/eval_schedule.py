"""When the learner evaluates held-out prompts, and on what: the version its generators were just
sent, while they hold it (docs/design.md §6).

The weight broadcaster's sender calls :meth:`Evaluator.after_sync` (in a worker thread) once a
version is on the generators, and sends no next version before it returns: every evaluated token is of that
version, and the score is logged at step = that version. The training loop goes on meanwhile; it
waits only if it has a newer version to publish before the evaluation ends. Rollouts go on too,
on the same generators. Versions evaluated: the first one sent (the start), every
``run.eval_every``-th, and the last (``run.steps``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import trio

from asyncrl.recipe import Recipe
from asyncrl.rollout.held_out_eval import EvalReport, Evaluation

log = logging.getLogger("asyncrl.learner")


class Evaluator:
    def __init__(
        self,
        evaluation: Evaluation,
        *,
        every: int,
        last: int,
        timeout_s: float,
        metrics: Any = None,
        note: Callable[[str], None] | None = None,
    ):
        """``metrics``: a sink with ``log(dict, step=)`` (process ``eval``); ``note``: prints one line
        to the user."""
        self.evaluation = evaluation
        self.every = every
        self.last = last
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.note = note
        self.reports: dict[int, EvalReport] = {}

    @classmethod
    def from_recipe(
        cls, r: Recipe, *, metrics: Any = None, note: Callable[[str], None] | None = None
    ) -> Evaluator | None:
        """None when the recipe has no held-out prompts."""
        evaluation = Evaluation.from_recipe(r)
        if evaluation is None:
            return None
        return cls(
            evaluation,
            every=r.run.eval_every,
            last=r.run.steps,
            timeout_s=r.rollout.request_timeout_s,
            metrics=metrics,
            note=note,
        )

    def due(self, version: int) -> bool:
        if version in self.reports:
            return False
        first = not self.reports
        return first or (self.every > 0 and version % self.every == 0) or version >= self.last

    def after_sync(self, report: Any) -> None:
        """The broadcaster's hook (a :class:`~asyncrl.weights.broadcaster.SyncReport`): evaluate
        ``report.version`` on the generators that now hold it, if it is due."""
        if not report.error and report.updated:
            self.evaluate(report.version, list(report.updated))

    def evaluate(self, v: int, urls: list[str]) -> None:
        """Evaluate version ``v`` on ``urls``, if due; the broadcaster's sender calls it
        (``after_sync``, ``between_versions``) so no other version reaches them meanwhile. Never
        raises: a failed evaluation is a log line, not the learner's end.

        The broadcaster calls it in one of the control plane's worker threads; the evaluation's
        requests run back on that plane's trio loop (``trio.from_thread``), not in a loop of their
        own, so the learner's process has one event loop and the evaluation's HTTP clients and MCP
        sessions live where the rest of its I/O does."""
        if not urls or not self.due(v):
            return
        try:
            result = trio.from_thread.run(
                functools.partial(self.evaluation.arun, urls, version=v, timeout_s=self.timeout_s)
            )
        except Exception as e:
            log.warning("held-out evaluation of version %d failed: %s: %s", v, type(e).__name__, e)
            return
        self.reports[v] = result
        if self.metrics is not None:
            self.metrics.log(result.metrics(), step=v)
        line = (
            f"asyncrl learner: held-out success {result.score:.3f} at version {v} "
            f"({result.prompts} prompts on {len(urls)} generator(s), "
            f"{result.seconds:.1f} s)"
        )
        if result.failed or result.other_version:
            line += f"; {result.failed} failed, {result.other_version} of another version"
        if self.note is not None:
            self.note(line)
        else:
            log.info(line)
