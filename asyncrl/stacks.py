"""Every asyncrl process writes all its threads' Python stacks to stderr (its log) on SIGUSR1 and
goes on: what a process about to be killed for hanging was doing (``kill -USR1 PID``; `asyncrl run`
passes it to its children's process groups, tools/gpu/check.sh sends it before each limit)."""

from __future__ import annotations

import faulthandler
import io
import signal
import sys


def dump_stacks_on_usr1() -> None:
    """Register the dump (faulthandler's, which runs even while the process is stuck in C code)."""
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (AttributeError, ValueError, io.UnsupportedOperation):
        # sys.stderr without a file descriptor (a test harness capturing it): the process's own
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
