"""What every asyncrl command shows its user while it runs: one progress display, one way to read it.

`asyncrl run`, `asyncrl learner` and `asyncrl rollout` all show progress the same way: a rich bar on
a terminal, a plain line every ``every_s`` seconds otherwise (a log file). The numbers come from the
run's metrics.jsonl (:class:`MetricsTail`, :func:`progress_info`) or the process's own counters.
:class:`Throttle` keeps a message that repeats on every retry (a learner that is gone) to one line a
minute, and :class:`StderrHandler` keeps log lines above the bar instead of through it.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl import metric_names as names

PLAIN_EVERY_S = 15.0
"""Without a terminal, one progress line per this many seconds."""


class Display:
    """A rich progress bar of versions on a terminal, a line every ``every_s`` otherwise."""

    def __init__(
        self,
        total: int,
        *,
        enabled: bool,
        label: str = "asyncrl run",
        every_s: float = PLAIN_EVERY_S,
    ):
        self.total, self.label, self.every_s = total, label, every_s
        self._last_line = -math.inf  # the first update prints, however young the clock
        self._progress = None
        if enabled and sys.stderr.isatty():
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(bar_width=20),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[info]}"),
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("version", total=total, info="starting")

    def update(self, version: int, info: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=min(version, self.total), info=info)
        elif time.monotonic() - self._last_line > self.every_s:
            self._last_line = time.monotonic()
            print(f"{self.label}: version {version}/{self.total}  {info}", file=sys.stderr)

    def note(self, text: str) -> None:
        """A message of its own line (above the bar on a terminal)."""
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


class MetricsTail:
    """Reads the lines appended to metrics.jsonl since the last call; keeps the latest values."""

    def __init__(self, path: Path):
        self.path, self._pos, self._partial = path, 0, b""
        self.latest: dict[str, Any] = {}
        self.max_staleness_seen: float | None = None
        self.learner_step = 0

    def update(self) -> None:
        try:
            with self.path.open("rb") as f:
                f.seek(self._pos)
                data = f.read()
                self._pos = f.tell()
        except OSError:
            return
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        for line in lines:
            try:
                rec = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(rec, dict):
                self._take(rec)

    def _take(self, rec: dict) -> None:
        if rec.get("process") == "learner" and isinstance(rec.get("step"), int):
            self.learner_step = max(self.learner_step, rec["step"])
        for k, v in rec.items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                self.latest[k] = v
                if k == names.STALENESS_MAX:
                    m = self.max_staleness_seen
                    self.max_staleness_seen = v if m is None else max(m, v)

    def get(self, key: str) -> float | None:
        v = self.latest.get(key)
        return None if v is None else float(v)


def fmt(v: float | None, spec: str) -> str:
    """A number for a progress line, "-" when there is none yet."""
    return "-" if v is None else format(v, spec)


def progress_info(tail: MetricsTail, eta: int, *, sft: bool = False) -> str:
    """The run's latest reward, staleness and throughput, as `asyncrl run` and the learner show."""
    if sft:
        loss, tps = tail.get(names.LOSS), tail.get(names.TRAINED_TOKENS_PER_S)
        return f"loss {fmt(loss, '.3f')}  train {fmt(tps, ',.0f')} tok/s"

    reward = tail.get(names.REWARD_MEAN)
    smean, smax = tail.get(names.STALENESS_MEAN), tail.max_staleness_seen
    gen, train = tail.get(names.GENERATED_TOKENS_PER_S), tail.get(names.TRAINED_TOKENS_PER_S)
    return (
        f"reward {fmt(reward, '.2f')}  staleness {fmt(smean, '.1f')} (max {fmt(smax, 'g')}"
        f"/{eta})  gen {fmt(gen, ',.0f')} tok/s  train {fmt(train, ',.0f')} tok/s"
    )


class Throttle:
    """Logs a message that recurs (a retry that keeps failing) once per ``period_s`` per key, with
    how many repeats it held back; :meth:`ok` re-arms a key, so the next failure shows at once."""

    def __init__(
        self,
        logger: logging.Logger,
        period_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.logger, self.period_s, self.clock = logger, period_s, clock
        self._seen: dict[str, tuple[float, int]] = {}

    def warning(self, key: str, msg: str, *args: Any) -> bool:
        """Log ``msg % args`` unless ``key`` was logged less than ``period_s`` ago; True if logged."""
        now = self.clock()
        last, held = self._seen.get(key, (None, 0))
        if last is not None and now - last < self.period_s:
            self._seen[key] = (last, held + 1)
            return False
        if held:
            msg += f" ({held} more like it in the last {now - last:.0f} s)"
        self.logger.warning(msg, *args)
        self._seen[key] = (now, 0)
        return True

    def ok(self, key: str) -> None:
        self._seen.pop(key, None)


class StderrHandler(logging.StreamHandler):
    """A log handler that writes to whatever ``sys.stderr`` is at the time: while a rich bar is
    shown (it redirects stderr), log lines then appear above the bar instead of through it."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> Any:  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler.__init__ sets it; the property wins
        pass
