"""asyncrl.progress: the shared progress display, the once-a-minute log of a failing retry, and the
log handler that follows sys.stderr (the rich bar replaces it)."""

from __future__ import annotations

import io
import logging
import sys

from asyncrl import progress


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_throttle_logs_a_recurring_failure_once_per_period(caplog):
    log = logging.getLogger("test.throttle")
    clock = Clock()
    quiet = progress.Throttle(log, period_s=60.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.throttle"):
        for _ in range(6):  # a retry every 10 s for a minute: one line
            quiet.warning("acquire", "acquire: %s; retrying", "no reply")
            clock.t += 10.0
        assert quiet.warning("acquire", "acquire: %s; retrying", "no reply")  # 60 s later
        assert not quiet.warning("acquire", "acquire: again")
        assert quiet.warning("put", "put: no reply")  # another key has its own minute
        quiet.ok("acquire")  # it worked: the next failure is news, shown at once
        assert quiet.warning("acquire", "acquire: failed after a success")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "acquire: no reply; retrying",
        "acquire: no reply; retrying (5 more like it in the last 60 s)",
        "put: no reply",
        "acquire: failed after a success",
    ]


def test_stderr_handler_writes_to_the_current_stderr(monkeypatch):
    """A rich bar swaps sys.stderr for a proxy that prints above it: log lines must follow."""
    handler = progress.StderrHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger("test.stderr")
    log.addHandler(handler)
    log.propagate = False
    try:
        first, second = io.StringIO(), io.StringIO()
        monkeypatch.setattr(sys, "stderr", first)
        log.warning("one")
        monkeypatch.setattr(sys, "stderr", second)
        log.warning("two")
    finally:
        log.removeHandler(handler)
    assert first.getvalue() == "one\n" and second.getvalue() == "two\n"


def test_display_without_a_terminal_prints_a_line_per_interval(capsys):
    d = progress.Display(10, enabled=True, label="asyncrl learner", every_s=3600)
    d.update(1, "reward 0.10")
    d.update(2, "reward 0.20")  # within the interval: not printed
    d.note("asyncrl learner: listening on ...")
    d.close()
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "asyncrl learner: version 1/10  reward 0.10",
        "asyncrl learner: listening on ...",
    ]
