from __future__ import annotations

from asyncrl import backoff


def test_doubles_from_first_then_holds_at_cap():
    delays = [backoff.delay_s(a, first=0.2, cap=5.0) for a in range(8)]
    assert delays == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0]


def test_huge_attempt_counts_stay_at_cap():
    assert backoff.delay_s(10_000, first=0.01, cap=1.0) == 1.0


def test_the_first_retry_waits_first():
    assert backoff.delay_s(0, first=0.1, cap=2.0) == 0.1
