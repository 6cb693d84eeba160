"""Exponential back-off: the one rule every retry loop waits by (buffer calls, generators, resumes).

Pure: it says how long to wait, the caller sleeps. Doubling from ``first`` and capped at ``cap`` so a
long outage is retried at a steady pace instead of ever more rarely.
"""

from __future__ import annotations

_MAX_DOUBLINGS = 60  # 2**60 outgrows any cap; keeps a huge attempt count from overflowing a float


def delay_s(attempt: int, *, first: float, cap: float) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): ``first · 2**attempt``, at most ``cap``."""
    return min(first * 2.0 ** min(max(attempt, 0), _MAX_DOUBLINGS), cap)
