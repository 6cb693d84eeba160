"""A rollout worker's starts, counted: granted by the buffer, unused, in flight, spent.

The buffer grants starts in leases (``wire.Grant``); the worker may have a group in flight only on a
start it holds. Pure book-keeping (no I/O, no clock of its own: callers pass times), so the
admission invariant is tested directly (tests/rollout/test_leases.py): never more groups in flight
than starts granted and not yet spent. A group is in flight from the moment it takes a start until
the buffer acknowledged or rejected it (``settled``), or it failed or was cancelled (``dropped``).
A start is spent when its group is settled, when it is given back (``spend`` once the release was
sent), or when its lease ends while it is still unused (``expire``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Start:
    """One granted start: its lease, the version it was granted at, and when the lease ends."""

    lease_id: str
    version: int
    expires_at: float  # the caller's clock


class LeaseBook:
    """The starts of one worker. ``max_over_granted`` (in flight minus open, at its highest) must stay
    <= 0; ``peak_in_flight`` is the most groups ever in flight at once."""

    def __init__(self) -> None:
        self.unused: deque[Start] = deque()  # granted, no group has taken them yet (oldest first)
        self.open = 0  # granted and not yet spent
        self.running: dict[str, Start] = {}  # group id -> its start, while the group is produced
        self.unsent: dict[str, Start] = {}  # group id -> its start, until the buffer settles it
        self.max_over_granted = 0
        self.peak_in_flight = 0

    @property
    def in_flight(self) -> int:
        return len(self.running) + len(self.unsent)

    def wanted(self, cap: int) -> int:
        """How many starts to ask for: room under ``cap`` groups that unused starts do not fill."""
        return cap - self.in_flight - len(self.unused)

    def can_start(self, cap: int) -> bool:
        return bool(self.unused) and self.in_flight < cap

    def grant(self, lease_id: str, version: int, k: int, expires_at: float) -> None:
        self.open += k
        self.unused.extend(Start(lease_id, version, expires_at) for _ in range(k))
        self._check()

    def expire(self, now: float) -> int:
        """Forget unused starts whose lease has ended (the buffer took them back); how many."""
        n = 0
        while self.unused and self.unused[0].expires_at <= now:
            self.unused.popleft()
            n += 1
        if n:
            self.spend(n)
        return n

    def start(self, group_id: str) -> Start:
        """The group takes the oldest unused start."""
        start = self.unused.popleft()
        self.running[group_id] = start
        self._check()
        return start

    def finished(self, group_id: str) -> None:
        """The group is whole; it stays in flight until the buffer settles it."""
        self.unsent[group_id] = self.running.pop(group_id)

    def settled(self, group_id: str) -> None:
        """The buffer acknowledged or rejected the group: its start is spent."""
        del self.unsent[group_id]
        self.spend(1)

    def dropped(self, group_id: str) -> Start:
        """The group failed or was cancelled: no longer in flight. Its start stays open until it is
        given back (:meth:`spend`) or its lease ends."""
        return self.running.pop(group_id)

    def take_stale(self, oldest_ok: int) -> list[Start]:
        """Unused starts granted below version ``oldest_ok`` (their groups could never be trained),
        oldest first, for the caller to give back; :meth:`spend` them once that is done."""
        out = []
        while self.unused and self.unused[0].version < oldest_ok:
            out.append(self.unused.popleft())
        return out

    def spend(self, n: int) -> None:
        """``n`` starts no group holds any more were given back or taken back."""
        self.open -= n
        self._check()

    def surrender(self) -> dict[str, int]:
        """On the way out: every start not spent (unused, running, unacknowledged), counted per
        lease for the caller to give back; nothing is open or unused afterwards. The groups still in
        flight (being cancelled with the worker) stay counted, unchecked."""
        by_lease: dict[str, int] = {}
        for p in [*self.unused, *self.running.values(), *self.unsent.values()]:
            by_lease[p.lease_id] = by_lease.get(p.lease_id, 0) + 1
        self.unused.clear()
        self.open -= sum(by_lease.values())
        return by_lease

    def _check(self) -> None:
        self.max_over_granted = max(self.max_over_granted, self.in_flight - self.open)
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
