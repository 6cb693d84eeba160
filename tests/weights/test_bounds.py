"""Rank 0's broadcast of a bucket is bounded by ``weights.timeout_s`` and a timed-out one is a failure.

A real second process joins a real gloo weight group and never takes part in the broadcast (a
generator stuck elsewhere). The group's own timeout is long (60 s), the broadcast's bound short, so
what ends the wait is the broadcaster's bound, not gloo's. The bound must report a failure (the
broadcaster then drops the group), never a success after which a version would count as sent.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from asyncrl.weights import rendezvous
from asyncrl.weights.process_groups import broadcast_bucket

pytestmark = pytest.mark.slow  # real processes

PEER = Path(__file__).with_name("silent_peer.py")
GROUP_TIMEOUT_S = 60.0  # gloo's own bound: far beyond the broadcast's
BOUND_S = 2.0  # the broadcast's bound (weights.timeout_s)


@pytest.fixture
def silent_group() -> Iterator[dist.ProcessGroup]:
    """Rank 0 of a 2-rank gloo weight group whose rank 1 (a real process) never broadcasts."""
    store = rendezvous.host_store("127.0.0.1", GROUP_TIMEOUT_S)  # listening before the peer starts
    port = store.port
    peer = subprocess.Popen(
        [sys.executable, str(PEER), str(port), "silent", str(GROUP_TIMEOUT_S)],
        stdin=subprocess.PIPE,
    )
    try:
        pg = rendezvous.init_custom_process_group(
            master_address="127.0.0.1",
            master_port=port,
            rank=0,
            world_size=2,
            group_name="silent",
            backend="gloo",
            timeout_s=GROUP_TIMEOUT_S,
        )
        del store
        yield pg
    finally:
        assert peer.stdin is not None
        peer.stdin.close()  # the peer exits: a pending collective fails at once, not after 60 s
        try:
            peer.wait(timeout=30)
        except subprocess.TimeoutExpired:
            peer.kill()
            peer.wait(timeout=30)
    rendezvous.abandon_process_group(pg)


def test_broadcast_to_a_peer_that_never_receives_fails_within_the_bound(silent_group):
    """gloo's ``wait(timeout)`` raises when the bound passes: a failure, after about the bound."""
    t0 = time.monotonic()
    err = broadcast_bucket({"g": silent_group}, [torch.ones(1000)], BOUND_S).get("g")
    elapsed = time.monotonic() - t0
    assert err is not None and err.startswith("broadcast: ")
    assert BOUND_S * 0.9 <= elapsed < BOUND_S + 8, elapsed


class _WaitThatOnlyLogs:
    """A test fake around a real gloo Work: its ``wait(timeout)`` returns when the bound passes
    instead of raising, as a ``Work.wait`` that only logs its timeout does (ProcessGroupNCCL's
    ``WorkNCCL::wait`` breaks out of its loop with a log line, and throws only if the work holds
    an exception by then). A real gloo Work cannot show it: gloo's wait raises "Operation timed
    out!"."""

    def __init__(self, work: dist.Work):
        self.work = work

    def wait(self, timeout: timedelta) -> bool:
        try:
            return self.work.wait(timeout)
        except RuntimeError:  # the timeout: swallowed, as a log-only wait does
            return True

    def is_completed(self) -> bool:
        return self.work.is_completed()


def test_a_wait_that_returns_without_completion_is_a_failure(silent_group, monkeypatch):
    """The path NCCL takes too: completion is checked after the wait, not taken from its return."""
    real = dist.broadcast

    def broadcast(*args, **kwargs):
        return _WaitThatOnlyLogs(real(*args, **kwargs))

    monkeypatch.setattr(dist, "broadcast", broadcast)
    t0 = time.monotonic()
    errs = broadcast_bucket({"g": silent_group}, [torch.ones(1000), torch.ones(10)], BOUND_S)
    err = errs.get("g")
    elapsed = time.monotonic() - t0
    assert err is not None and "not complete" in err
    assert elapsed < BOUND_S + 8, elapsed  # the second tensor's wait did not add another bound
