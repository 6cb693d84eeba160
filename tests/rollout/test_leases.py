"""The worker's lease accounting (asyncrl/rollout/leases.py), driven the way the worker drives it:
grants, starts, finished and failed groups, acks, releases, expiries, stale versions, shutdown."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from asyncrl.rollout.leases import LeaseBook, Start

CAP = 4


def test_a_group_holds_its_start_until_the_buffer_settles_it():
    book = LeaseBook()
    assert book.wanted(CAP) == CAP
    book.grant("L1", version=3, k=2, expires_at=10.0)
    assert book.open == 2 and book.wanted(CAP) == CAP - 2 and book.can_start(CAP)
    assert book.start("g1") == Start("L1", 3, 10.0)
    book.finished("g1")
    assert book.in_flight == 1 and book.open == 2  # sent, not acknowledged: still held
    book.settled("g1")
    assert book.in_flight == 0 and book.open == 1
    assert book.max_over_granted <= 0 and book.peak_in_flight == 1


def test_a_failed_group_keeps_its_start_open_until_it_is_given_back():
    book = LeaseBook()
    book.grant("L1", version=0, k=1, expires_at=10.0)
    book.start("g1")
    assert book.dropped("g1").lease_id == "L1"
    assert book.in_flight == 0 and book.open == 1 and book.wanted(CAP) == CAP
    book.spend(1)  # the release went out
    assert book.open == 0


def test_unused_starts_expire_and_stale_ones_are_taken_oldest_first():
    book = LeaseBook()
    book.grant("old", version=1, k=2, expires_at=5.0)
    book.grant("new", version=4, k=1, expires_at=9.0)
    assert book.expire(now=4.0) == 0
    assert [p.lease_id for p in book.take_stale(oldest_ok=2)] == ["old", "old"]
    assert book.open == 3  # given back only once the release is sent
    book.spend(2)
    assert book.expire(now=9.0) == 1 and book.open == 0 and not book.unused


def test_surrender_counts_every_start_not_spent_per_lease():
    book = LeaseBook()
    book.grant("A", version=0, k=3, expires_at=10.0)
    book.grant("B", version=0, k=1, expires_at=10.0)
    book.start("g1")  # running
    book.start("g2")
    book.finished("g2")  # unacknowledged
    assert book.surrender() == {"A": 3, "B": 1}
    assert not book.unused and book.open == 0


class WorkerProtocol(RuleBasedStateMachine):
    """Random interleavings of everything the worker does; a model counts the starts that were
    dropped or taken as stale and not yet given back (the only ones open without a holder)."""

    def __init__(self) -> None:
        super().__init__()
        self.book = LeaseBook()
        self.now = 0.0
        self.version = 0
        self.seq = 0
        self.releasing = 0  # starts taken off the book, release not yet sent

    @rule(k=st.integers(0, CAP), lease_s=st.floats(0.5, 5.0))
    def acquire(self, k: int, lease_s: float) -> None:
        k = min(k, max(self.book.wanted(CAP), 0))  # the worker raises on more than it asked for
        if k:
            self.book.grant(f"L{self.seq}", self.version, k, self.now + lease_s)
            self.seq += 1

    @rule()
    def start_what_fits(self) -> None:
        while self.book.can_start(CAP):
            self.seq += 1
            self.book.start(f"g{self.seq}")

    @precondition(lambda self: self.book.running)
    @rule(data=st.data(), ok=st.booleans())
    def a_group_ends(self, data, ok: bool) -> None:
        gid = data.draw(st.sampled_from(sorted(self.book.running)))
        if ok:
            self.book.finished(gid)
        else:  # failed, or cancelled as stale: its start is given back
            self.book.dropped(gid)
            self.releasing += 1

    @precondition(lambda self: self.book.unsent)
    @rule(data=st.data())
    def the_buffer_settles_one(self, data) -> None:
        self.book.settled(data.draw(st.sampled_from(sorted(self.book.unsent))))

    @precondition(lambda self: self.releasing)
    @rule(data=st.data())
    def releases_go_out(self, data) -> None:
        n = data.draw(st.integers(1, self.releasing))
        self.book.spend(n)
        self.releasing -= n

    @rule(dt=st.floats(0.0, 3.0))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        self.book.expire(self.now)

    @rule(eta=st.integers(0, 2))
    def a_new_version(self, eta: int) -> None:
        self.version += 1
        self.releasing += len(self.book.take_stale(self.version - eta))

    @invariant()
    def never_more_in_flight_than_granted(self) -> None:
        b = self.book
        assert b.in_flight <= b.open and b.max_over_granted <= 0
        assert b.open == len(b.unused) + b.in_flight + self.releasing
        assert b.peak_in_flight <= CAP and b.in_flight <= CAP
        assert b.wanted(CAP) == CAP - b.in_flight - len(b.unused)

    def teardown(self) -> None:
        held = len(self.book.unused) + self.book.in_flight
        assert sum(self.book.surrender().values()) == held
        assert not self.book.unused


WorkerProtocol.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_the_worker_protocol_keeps_the_invariant = WorkerProtocol.TestCase


@pytest.mark.parametrize("k", [0, 1, CAP])
def test_wanted_never_counts_unused_starts_twice(k):
    book = LeaseBook()
    book.grant("L", version=0, k=k, expires_at=1.0)
    assert book.wanted(CAP) == CAP - k
