"""Thread priority for the weight transfer's threads, on both sides of it.

The learner's sender and the built-in engine's receiver both run beside a hot loop (the training
step, the decode step) on shared CPU cores: at a lower priority the transfer takes that loop's
leftovers instead of competing with it.
"""

from __future__ import annotations

import os
import threading

BACKGROUND_NICE = 10
"""The niceness of a transfer thread (the hot loop stays at 0)."""


def lower_priority(nice: int = BACKGROUND_NICE) -> None:
    """Run the calling thread at niceness ``nice`` (Linux nice is per thread, and the gloo threads
    of a group built from it inherit it). Where that is not possible (not Linux, not allowed), the
    thread runs at normal priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (OSError, AttributeError):
        pass
