"""What `asyncrl run` shows while it runs: the buffer's status and the metrics file, once a second, on
the progress display (:mod:`asyncrl.progress`); and the bound on the learner's start-up."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from asyncrl import progress as progress_mod
from asyncrl.launch.plan import LaunchError
from asyncrl.recipe import Recipe

POLL_EVERY_S = 1.0
STATUS_TIMEOUT_S = 0.25
"""A status poll's wait: the supervisor notices a child's exit only after it, and the buffer on
this host answers in milliseconds (a learner that has just exited never answers)."""


class RunWatch:
    """The run's progress, polled at most once per ``POLL_EVERY_S``; ``status`` is the buffer's
    last answer (None before the first)."""

    def __init__(self, r: Recipe, buffer_address: str, run_dir: Path, *, t0: float, enabled: bool):
        self.r, self.buffer_address, self.t0 = r, buffer_address, t0
        self.uses_buffer = r.algorithm.uses_rollouts
        self.status: dict[str, Any] | None = None
        self.healthy = False
        self.display = progress_mod.Display(r.run.steps, enabled=enabled)
        self.tail = progress_mod.MetricsTail(run_dir / "metrics.jsonl")
        self._last_poll = 0.0

    def tick(self) -> None:
        """Poll and redraw if a second has passed; LaunchError if the buffer never answered within
        ``generator.startup_timeout_s``."""
        r, now = self.r, time.monotonic()
        if now - self._last_poll < POLL_EVERY_S:
            return
        self._last_poll = now
        st = None
        if self.uses_buffer:
            from asyncrl.buffer.client import buffer_status  # pynng: only a run with a buffer

            st = buffer_status(self.buffer_address, r, timeout_s=STATUS_TIMEOUT_S)
        if st is not None:
            self.status, self.healthy = st, True
        elif (
            self.uses_buffer and not self.healthy and now - self.t0 > r.generator.startup_timeout_s
        ):
            raise LaunchError(
                f"the learner's buffer at {self.buffer_address} did not answer within "
                f"{r.generator.startup_timeout_s:g} s (generator.startup_timeout_s)"
            )
        self.tail.update()
        version = int(self.status.get("version", 0)) if self.status else self.tail.learner_step
        info = progress_mod.progress_info(
            self.tail, r.buffer.max_staleness, sft=not self.uses_buffer
        )
        self.display.update(version, info)

    def close(self) -> None:
        self.display.close()
