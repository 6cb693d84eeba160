"""The staleness-bounded replay store (docs/design.md §2, §3): pure logic, no I/O, time passed in as ``now``.

Admission control keeps the bound without waste. A worker holds a *lease*: ``k`` *starts*, each the
right to start one group, until the lease expires. Every start counts against the bound from the
moment it is granted until its group is trained on or dropped (or the start is returned unused):

    started = consumed + stored + in_flight        (in_flight: unused starts of live leases)

and a worker may start another group only while ``started < (version + max_staleness + 1) * B``
(AReaL's rule, B = groups_per_batch) and at most ``depth * B`` groups wait or run. The depth is at
most ``max_staleness + 1`` batches, or ``max_batches_ahead`` if fewer (the bound stays a bound, the
data gets fresher; one batch ahead is enough to overlap generation with training). By default
(``adaptive_depth_wait``) it starts at 1 and deepens only where depth buys the learner time
(:meth:`ReplayStore.take_batch`); with ``adaptive_depth_ess`` / ``adaptive_depth_kl`` the learner's
measured drift lowers it (:meth:`ReplayStore.adapt_depth`); with all three off it is the maximum.
With max_staleness 0 this admits exactly B groups per version, which is synchronous RL: batch k
holds only groups started at version k.

Admission alone is not a proof (groups arrive out of order), so the bound is enforced again on the
data: a group's *behaviour version* is the oldest of its own tokens' versions and of its lease's
version (the version at which its start was granted), and a group whose behaviour version is below
``version - max_staleness`` is rejected at put time or dropped before a batch is formed. Every drop
returns its start, so the worker can start a replacement and training never stalls on waste. Leases
expire and return their unused starts; a lease whose version is already too old to train on is
closed when the version moves on.

Delivery is exactly once: a put is acknowledged only once stored, a resent group (same id) is
acknowledged and ignored, and :meth:`ReplayStore.state_dict` holds everything needed to resume
(counters, leases, stored groups, ids already seen) as JSON-able plain data.
"""

from __future__ import annotations

import base64
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncrl import wire
from asyncrl.recipe import BufferConfig

STATE_FORMAT = 1


@dataclass
class Batch:
    """Whole groups for one optimizer step; ``version`` is the policy version they are trained at."""

    groups: list[wire.Group]
    version: int
    stats: dict[str, Any]


@dataclass(kw_only=True)
class _Lease:
    id: str
    worker_id: str
    version: int
    k: int
    used: int = 0  # starts spent: groups that arrived under this lease, plus released starts
    expires_at: float
    request_id: str = ""  # the worker's id for the acquire, so a resent acquire gets this lease

    @property
    def remaining(self) -> int:
        return self.k - self.used


@dataclass(kw_only=True)
class _Stored:
    group: wire.Group
    version: int  # behaviour version used for the bound and the FIFO order
    seq: int  # arrival order, the tie-break among equal versions


def _counter_names() -> list[str]:
    return [
        "granted",  # starts granted, summed over leases
        "arrived",  # starts spent by a group arriving under its live lease
        "released",  # starts given back by workers
        "expired",  # starts returned because their lease expired unused
        "abandoned",  # starts returned because the worker holding them restarted
        "closed_stale",  # starts returned because their lease became too old to train on
        "late_accepted",  # groups stored without a live lease (it expired), within capacity
        "stored_total",  # groups ever stored
        "consumed",  # groups handed to the learner
        "batches",
        "acquires",
        "admission_waits",  # acquires answered with k = 0
        "duplicates",  # resent groups acknowledged and ignored
        "overlong_samples",  # samples whose loss mask the overlong filter zeroed
        "readmitted",  # acknowledged groups stored again from the journal after a restart
    ]


@dataclass
class _Counters:
    values: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_counter_names(), 0))
    dropped: dict[str, int] = field(default_factory=dict)  # acknowledged, then not trained on
    rejected: dict[str, int] = field(default_factory=dict)  # refused at put time
    bad_messages: dict[str, int] = field(default_factory=dict)
    staleness_hist: dict[int, int] = field(default_factory=dict)  # over all batches


def _bump(d: dict, key: Any, n: int = 1) -> None:
    d[key] = d.get(key, 0) + n


def _no_signal(g: wire.Group) -> bool:
    """DAPO's dynamic sampling drops a group whose advantages would all be 0: its rewards are all
    equal and, under ReMax, equal to its greedy baseline too (else they all differ from it). A group
    estimator's rule: with a critic such a group has A = R − V ≠ 0, and the recipe refuses it."""
    b = g.baseline_reward
    values = set(g.rewards) | ({b} if b is not None else set())
    return len(values) == 1 and len(g.samples) + (b is not None) > 1


def _token_version(group: wire.Group) -> tuple[int, int] | None:
    """(oldest, newest) version over the group's tokens; None for a group with no tokens.

    "Oldest" is the group's behaviour version (``wire.Sample.behavior_version``: the policy's own
    tokens, or all tokens of a sample that has none); computed group-wide in the common case.
    """
    versions = wire.group_tokens(group, "versions")  # no sample is built for this
    if not len(versions):
        return None
    mask = wire.group_tokens(group, "loss_mask")
    if mask.all():
        return int(versions.min()), int(versions.max())
    samples = [s for s in group.samples if len(s.versions)]
    return min(s.behavior_version for s in samples), int(versions.max())


class ReplayStore:
    """Admission, storage and batching of groups under a staleness bound; see the module docstring.

    Every method that can depend on time takes ``now`` (seconds, any monotonic clock: the store only
    compares it with lease deadlines it computed from earlier ``now`` values).
    """

    def __init__(self, cfg: BufferConfig, *, nonce: str = "L", version: int = 0) -> None:
        self.cfg = cfg
        self._nonce = nonce  # makes lease ids unique across restarts from the same checkpoint
        self._version = version
        self._now = -math.inf
        self._lease_seq = 0
        self._seq = 0
        self._leases: dict[str, _Lease] = {}  # live: unused starts, not expired
        self._old_leases: dict[str, int] = {}  # closed or expired: id -> version (late arrivals)
        self._stored: dict[str, _Stored] = {}
        self._heap: list[tuple[int, int, str]] = []  # (version, seq, group id), oldest first
        # Group ids already answered, so a resend gets the same answer: acknowledged id -> oldest
        # token version; rejected id -> (oldest token version, reason). Trimmed as versions pass.
        self._seen: dict[str, int] = {}
        self._data_states: dict[str, dict[str, Any]] = {}  # worker id -> its data position
        self._rejected: dict[str, tuple[int, str]] = {}
        self._c = _Counters()
        # The adaptive pipeline depth in batches (None: off, the configured depth holds); it
        # starts at 1, the freshest, and follows the learner's signals (adapt_depth).
        self._depth: int | None = 1 if self.adaptive else None
        # adaptive_depth_wait's evidence since the last batch: when the learner first found no
        # batch (None: it has not waited), and whether a worker was refused starts by the depth
        # alone (not the bound) while it waited.
        self._wanted_since: float | None = None
        self._throttled = False
        # Acknowledged groups dropped since the last drain: (id, reason), for the service's audit.
        self.dropped_ids: list[tuple[str, str]] = []

    # ---------------------------------------------------------------------------------------------
    # Derived quantities
    # ---------------------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def bound(self) -> int:
        """Most starts that may be in use at this version: (v + eta + 1) * B."""
        return (self._version + self.cfg.max_staleness + 1) * self.cfg.groups_per_batch

    @property
    def in_flight(self) -> int:
        """Starts granted under live leases and not yet used."""
        return sum(lease.remaining for lease in self._leases.values())

    @property
    def started(self) -> int:
        """Slots in use: consumed + stored + in flight (AReaL's accepted + running)."""
        return self._c.values["consumed"] + len(self._stored) + self.in_flight

    @property
    def adaptive(self) -> bool:
        """Whether the depth moves (``buffer.adaptive_depth_ess/kl/wait``)."""
        c = self.cfg
        return c.adaptive_depth_ess > 0 or c.adaptive_depth_kl > 0 or c.adaptive_depth_wait

    @property
    def max_depth(self) -> int:
        """The configured pipeline depth in batches: eta + 1, or ``max_batches_ahead`` if fewer."""
        batches = self.cfg.max_staleness + 1
        if self.cfg.max_batches_ahead:
            batches = min(batches, self.cfg.max_batches_ahead)
        return batches

    @property
    def depth(self) -> int:
        """The pipeline depth admission uses now, in batches (1 … :attr:`max_depth`)."""
        return self.max_depth if self._depth is None else min(self._depth, self.max_depth)

    def adapt_depth(self, ess: float | None, kl: float | None) -> int:
        """The learner's signals after a step: its importance weights' ESS and its KL(μ ‖ π_prox).
        While either says the policy moves fast (ESS below ``adaptive_depth_ess``, KL above
        ``adaptive_depth_kl``; a threshold of 0 is not consulted) one batch fewer may be ahead,
        down to 1; otherwise one more, up to :attr:`max_depth` (with ``adaptive_depth_wait`` only
        the learner's waits deepen it, :meth:`take_batch`). Returns the depth.

        Only admission changes: starts granted under a deeper pipeline stay valid, and the bound
        on the data (``min_version``) is untouched, so no group staler than eta is ever trained.
        """
        if self._depth is None:
            return self.depth
        c = self.cfg
        fast = (c.adaptive_depth_ess > 0 and ess is not None and ess < c.adaptive_depth_ess) or (
            c.adaptive_depth_kl > 0 and kl is not None and kl > c.adaptive_depth_kl
        )
        if fast:
            self._depth = max(1, self.depth - 1)
        elif not c.adaptive_depth_wait:
            self._depth = min(self.max_depth, self.depth + 1)
        return self.depth

    def _adapt_depth_to_waits(self, now: float) -> None:
        """``adaptive_depth_wait``, after a batch is taken: one batch deeper if the learner waited
        for it while a worker asked for starts that only the depth refused (the generator had room
        the pipeline did not give it); one shallower if another whole batch is already stored (the
        generator keeps up with less). Otherwise, and for the first batch (the pipeline filling),
        unchanged. Where the generator outruns the learner this holds 1 batch, the freshest data
        that still overlaps the two sides; where it is the bottleneck and full, depth buys nothing
        and is not added."""
        waited = self._wanted_since is not None and now > self._wanted_since
        first = self._c.values["batches"] == 0
        if self._depth is not None and self.cfg.adaptive_depth_wait and not first:
            if waited and self._throttled:
                self._depth = min(self.max_depth, self.depth + 1)
            elif not waited and len(self._stored) >= self.cfg.groups_per_batch:
                self._depth = max(1, self.depth - 1)
        self._wanted_since, self._throttled = None, False

    @property
    def capacity(self) -> int:
        """How many more groups may be started now.

        AReaL's rule, and a pipeline depth of (eta + 1) * B on top: when a version passes without a
        full batch (a partial batch, a weight reload), AReaL's rule alone would admit extra groups
        that the next batches cannot all take before they go stale, to be dropped as waste. With
        an adaptive depth (:meth:`adapt_depth`) the depth is the current one.
        """
        depth = self.depth * self.cfg.groups_per_batch
        return max(0, min(self.bound - self.started, depth - len(self._stored) - self.in_flight))

    @property
    def min_version(self) -> int:
        """The oldest behaviour version that can still be trained on at this version."""
        return self._version - self.cfg.max_staleness

    def stored_ids(self) -> list[str]:
        """Ids of the groups stored and not yet handed out, oldest first."""
        return [gid for _, _, gid in sorted(self._heap)]

    # ---------------------------------------------------------------------------------------------
    # Time and version
    # ---------------------------------------------------------------------------------------------

    def expire(self, now: float) -> int:
        """Close leases whose deadline passed; returns the number of starts they gave back."""
        self._now = max(self._now, now)
        return self._close_where(lambda x: x.expires_at <= self._now, "expired")

    def abandon(self, worker_id: str) -> int:
        """Close the leases of a worker that restarted (its old process died holding them);
        returns the number of starts they gave back."""
        return self._close_where(lambda x: x.worker_id == worker_id, "abandoned")

    def _close_where(self, pred: Callable[[_Lease], bool], counter: str) -> int:
        """Close the live leases ``pred`` picks, counting their unused starts under ``counter``."""
        returned = 0
        for lease in [x for x in self._leases.values() if pred(x)]:
            returned += lease.remaining
            self._c.values[counter] += lease.remaining
            self._close(lease)
        return returned

    def set_version(self, version: int) -> bool:
        """The learner's policy version after an optimizer step; returns whether it changed.

        Leases too old to train on are closed (their starts return), groups too old are dropped
        (their starts return), and the ids kept for deduplication are trimmed to the window in which
        a resent group could still be accepted.
        """
        if version < self._version:
            raise ValueError(
                f"policy version cannot go back from {self._version} to {version} "
                "(restore the buffer state saved with the checkpoint instead)"
            )
        if version == self._version:
            return False
        self._version = version
        floor = self.min_version
        self._close_where(lambda x: x.version < floor, "closed_stale")
        self._old_leases = {k: v for k, v in self._old_leases.items() if v >= floor}
        # A resent group whose id was forgotten here is older than `floor`, so it is rejected as stale.
        self._seen = {k: v for k, v in self._seen.items() if v >= floor}
        self._rejected = {k: v for k, v in self._rejected.items() if v[0] >= floor}
        self._drop_stale()
        return True

    def _close(self, lease: _Lease) -> None:
        del self._leases[lease.id]
        self._old_leases[lease.id] = lease.version

    def _drop_stale(self) -> None:
        floor = self.min_version
        while self._heap and self._heap[0][0] < floor:
            _, _, gid = heapq.heappop(self._heap)
            del self._stored[gid]
            _bump(self._c.dropped, "stale")
            self.dropped_ids.append((gid, "stale"))

    # ---------------------------------------------------------------------------------------------
    # Requests (each returns the wire reply)
    # ---------------------------------------------------------------------------------------------

    def acquire(self, worker_id: str, n: int, *, now: float, request_id: str = "") -> wire.Grant:
        """Grant up to ``n`` starts as one lease (k may be 0: at the bound, ask again later).

        A resent acquire (same worker and non-empty ``request_id``) whose lease is still live gets
        the same grant again instead of a second lease.
        """
        self.expire(now)
        if request_id:
            for lease in self._leases.values():
                if lease.request_id == request_id and lease.worker_id == worker_id:
                    return self._grant(lease)
        self._c.values["acquires"] += 1
        k = min(max(n, 0), self.capacity)
        room = self.bound - self.started  # what the bound alone would grant
        if self._wanted_since is not None and k < min(n, room):
            self._throttled = (
                True  # the depth, not the bound, refused starts while the learner waited
            )
        if k == 0:
            if n > 0:
                self._c.values["admission_waits"] += 1
            return wire.Grant(
                lease_id="",
                starts=0,
                version=self._version,
                lease_seconds=0.0,
                request_id=request_id,
            )
        self._lease_seq += 1
        lease = _Lease(
            id=f"{self._nonce}-{self._lease_seq}",
            worker_id=worker_id,
            version=self._version,
            k=k,
            expires_at=self._now + self.cfg.lease_seconds,
            request_id=request_id,
        )
        self._leases[lease.id] = lease
        self._c.values["granted"] += k
        return self._grant(lease)

    def _grant(self, lease: _Lease) -> wire.Grant:
        return wire.Grant(
            lease_id=lease.id,
            starts=lease.k,
            version=lease.version,
            lease_seconds=max(0.0, lease.expires_at - self._now),
            request_id=lease.request_id,
        )

    def release(self, lease_id: str, n: int, *, now: float) -> wire.Ok | wire.Error:
        """Give back up to ``n`` unused starts of a lease (cancelled or never-started groups)."""
        self.expire(now)
        lease = self._leases.get(lease_id)
        if lease is None:
            if lease_id in self._old_leases:
                return wire.Ok(version=self._version, message=f"lease {lease_id} already closed")
            return wire.Error(code="unknown_lease", message=f"release: unknown lease {lease_id!r}")
        r = min(max(n, 0), lease.remaining)
        lease.used += r
        self._c.values["released"] += r
        if lease.remaining == 0:
            self._close(lease)
        return wire.Ok(version=self._version, message=f"released {r}")

    def put(self, groups: list[wire.Group], *, now: float) -> wire.Ack:
        """Store whole groups. Acknowledged: stored, duplicates, and groups dropped by dynamic
        sampling (they are final, a resend would be dropped again). Rejected, with a reason: the
        rest; a rejected group is not stored and its start is spent."""
        self.expire(now)
        acked: list[str] = []
        rejected: dict[str, str] = {}
        for g in groups:
            new = g.id not in self._seen and g.id not in self._stored
            reason = self._put_one(g)
            if reason is None:
                acked.append(g.id)
                if new:
                    self._note_data_state(g)
            else:
                rejected[g.id] = reason
        return wire.Ack(group_ids=acked, rejected=rejected, version=self._version)

    def _note_data_state(self, g: wire.Group) -> None:
        """Keep the newest data position each worker attached to an acknowledged group, so it is
        checkpointed with the learner and a restarted worker neither repeats nor skips prompts.
        Journals written before ``Group.data_state`` existed hold it in ``metadata``."""
        worker = g.metadata.get("worker_id")
        state = g.data_state or g.metadata.get("data_state")
        if isinstance(worker, str) and isinstance(state, dict):
            self._data_states[worker] = state

    def _put_one(self, g: wire.Group) -> str | None:
        """None if acknowledged, else the reason for the rejection ("code: explanation")."""
        if g.id in self._seen or g.id in self._stored:
            self._c.values["duplicates"] += 1
            return None
        if g.id in self._rejected:  # a resend of a rejected group: same answer, counted once
            return self._rejected[g.id][1]
        tokens = _token_version(g)
        oldest = self._version if tokens is None else tokens[0]
        lease = self._leases.get(g.lease_id)
        if lease is not None:  # the group spent one start of its live lease, whatever comes next
            lease.used += 1
            self._c.values["arrived"] += 1
            if lease.remaining == 0:
                self._close(lease)
            lease_version: int | None = lease.version
        else:
            lease_version = self._old_leases.get(g.lease_id)
        if oldest < self.min_version:
            return self._reject(g, oldest, "stale", self._too_old(oldest))
        if lease_version is None:
            why = f"lease {g.lease_id!r} was never granted or is forgotten"
            return self._reject(g, oldest, "unknown_lease", why)
        if tokens is None:
            return self._reject(g, oldest, "empty", "no completion tokens to train on")
        if tokens[1] > self._version:
            why = f"tokens of version {tokens[1]} > {self._version}"
            return self._reject(g, oldest, "future_version", why)
        version = min(oldest, lease_version)
        if version < self.min_version:
            return self._reject(g, oldest, "stale", self._too_old(version))
        if lease is None:  # a late arrival takes a fresh start, so only while under the bound
            if self.capacity < 1:
                return self._reject(
                    g, oldest, "lease_expired", f"lease {g.lease_id} closed and no capacity left"
                )
            self._c.values["late_accepted"] += 1
        self._seen[g.id] = oldest
        if self.cfg.dynamic_sampling and _no_signal(g):
            _bump(self._c.dropped, "equal_rewards")  # never stored, so its start is free again
            self.dropped_ids.append((g.id, "equal_rewards"))
            return None
        self._seq += 1
        self._stored[g.id] = _Stored(group=g, version=version, seq=self._seq)
        heapq.heappush(self._heap, (version, self._seq, g.id))
        self._c.values["stored_total"] += 1
        return None

    def readmit(self, g: wire.Group) -> str:
        """Store again a group this buffer acknowledged after the checkpoint it was restored from
        (the service's journal). It was admitted once, so no lease is needed; ids already known are
        skipped, and the bound still holds: a group too old by now, or with tokens newer than this
        version (from the lost steps' weights), is dropped and counted. Returns "stored", "known",
        "stale", "future_version" or "equal_rewards"."""
        if g.id in self._seen or g.id in self._stored:
            return "known"
        self._note_data_state(g)  # acknowledged once: the worker's position moved past it
        tokens = _token_version(g)
        oldest = self._version if tokens is None else tokens[0]
        lease = self._leases.get(g.lease_id)
        if lease is not None:  # granted before the checkpoint: the group spent one of its starts
            lease.used += 1
            self._c.values["arrived"] += 1
            if lease.remaining == 0:
                self._close(lease)
        lease_version = lease.version if lease is not None else self._old_leases.get(g.lease_id)
        version = min(oldest, self._version if lease_version is None else lease_version)
        self._seen[g.id] = oldest
        if tokens is not None and tokens[1] > self._version:
            # Made by weights of steps the restart lost: no policy of this run produced them.
            _bump(self._c.dropped, "future_version")
            return "future_version"
        if version < self.min_version:
            _bump(self._c.dropped, "stale")
            return "stale"
        if self.cfg.dynamic_sampling and _no_signal(g):
            _bump(self._c.dropped, "equal_rewards")
            return "equal_rewards"
        self._seq += 1
        self._stored[g.id] = _Stored(group=g, version=version, seq=self._seq)
        heapq.heappush(self._heap, (version, self._seq, g.id))
        self._c.values["stored_total"] += 1
        self._c.values["readmitted"] += 1
        return "stored"

    def _too_old(self, version: int) -> str:
        return (
            f"behaviour version {version} < {self.min_version} "
            f"(version {self._version}, max_staleness {self.cfg.max_staleness})"
        )

    def _reject(self, g: wire.Group, oldest: int, code: str, why: str) -> str:
        reason = f"{code}: group {g.id}: {why}"
        self._rejected[g.id] = (oldest, reason)
        _bump(self._c.rejected, code)
        return reason

    def note_bad_message(self, code: str) -> None:
        """Count a message the service could not take (kept here so stats() has one source)."""
        _bump(self._c.bad_messages, code)

    # ---------------------------------------------------------------------------------------------
    # Batches
    # ---------------------------------------------------------------------------------------------

    def take_batch(self, now: float, *, allow_partial: bool = False) -> Batch | None:
        """B stored groups, the oldest (or with ``batch_order: newest`` the freshest), or None if
        there are fewer. With ``allow_partial`` (the learner has waited long enough), at least
        ``min_batch_fill * B`` groups are enough."""
        self.expire(now)
        self._drop_stale()
        b = self.cfg.groups_per_batch
        n = min(b, len(self._heap))
        least = max(1, math.ceil(self.cfg.min_batch_fill * b - 1e-9))
        if n < b and not (allow_partial and n >= least):
            if self._wanted_since is None:
                self._wanted_since = now
            return None
        if self.cfg.batch_order == "newest":  # the freshest versions, first come within one
            taken = heapq.nsmallest(n, self._heap, key=lambda e: (-e[0], e[1]))
            gone = {gid for _, _, gid in taken}
            self._heap = [e for e in self._heap if e[2] not in gone]
            heapq.heapify(self._heap)
        else:
            taken = [heapq.heappop(self._heap) for _ in range(n)]
        groups = [self._stored.pop(gid).group for _, _, gid in taken]
        staleness = [self._version - version for version, _, _ in taken]
        overlong = self._filter_overlong(groups) if self.cfg.overlong_filter else 0
        hist: dict[int, int] = {}
        for s in staleness:
            _bump(hist, s)
            _bump(self._c.staleness_hist, s)
        c = self._c.values
        self._adapt_depth_to_waits(now)
        c["consumed"] += n
        c["batches"] += 1
        c["overlong_samples"] += overlong
        return Batch(
            groups=groups,
            version=self._version,
            stats={
                "groups": n,
                "fill": n / b,
                "samples": sum(len(g.samples) for g in groups),
                "tokens": sum(s.num_tokens for g in groups for s in g.samples),
                "staleness_mean": sum(staleness) / n,
                "staleness_max": max(staleness),
                "max_staleness": self.cfg.max_staleness,  # the bound, for the staleness plot
                "staleness_hist": {str(k): v for k, v in sorted(hist.items())},
                # The same flat, for sinks that keep only numbers (one key per staleness 0..eta).
                **{
                    f"staleness_hist/{k}": hist.get(k, 0) for k in range(self.cfg.max_staleness + 1)
                },
                "overlong_samples": overlong,
                # groups dropped as stale so far: generation nobody trained (batch_order newest
                # trades it for fresher batches)
                "dropped_stale": self._c.dropped.get("stale", 0),
                **({"depth": self.depth} if self.adaptive else {}),
            },
        )

    @staticmethod
    def _filter_overlong(groups: list[wire.Group]) -> int:
        """Zero the loss mask of samples cut by max_new_tokens; whole groups are kept, since their
        rewards still shape the group's advantages."""
        n = 0
        for g in groups:
            for s in g.samples:
                if s.finish_reason == "length":
                    s.loss_mask = np.zeros_like(s.loss_mask)
                    s.metadata = {**s.metadata, "overlong": True}
                    n += 1
        return n

    # ---------------------------------------------------------------------------------------------
    # Metrics
    # ---------------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters for logging: occupancy, grants in flight, admission waits, staleness, drops."""
        c = self._c
        hist = c.staleness_hist
        total = sum(hist.values())
        return {
            "version": self._version,
            "occupancy": len(self._stored),
            "grants_in_flight": self.in_flight,
            "leases_live": len(self._leases),
            "starts_held": _starts_held(self._leases.values()),
            "started": self.started,
            "bound": self.bound,
            "capacity": self.capacity,
            **c.values,
            "staleness_mean": sum(k * v for k, v in hist.items()) / total if total else 0.0,
            "staleness_max": max(hist) if hist else 0,
            "staleness_hist": {str(k): v for k, v in sorted(hist.items())},
            "dropped": dict(c.dropped),
            "rejected": dict(c.rejected),
            "bad_messages": dict(c.bad_messages),
            "data_states": dict(self._data_states),
            **({"depth": self.depth} if self.adaptive else {}),
        }

    # ---------------------------------------------------------------------------------------------
    # Checkpoints
    # ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume, as JSON-able plain data (groups as base64 wire bytes).

        Lease deadlines are saved as seconds left, since the clock of the process that restores
        them is not this one's.
        """
        now = self._now if math.isfinite(self._now) else 0.0
        c = self._c
        return {
            "format": STATE_FORMAT,
            "version": self._version,
            "max_staleness": self.cfg.max_staleness,
            "groups_per_batch": self.cfg.groups_per_batch,
            "lease_seq": self._lease_seq,
            "seq": self._seq,
            "leases": [
                {
                    "id": x.id,
                    "worker_id": x.worker_id,
                    "version": x.version,
                    "k": x.k,
                    "used": x.used,
                    "seconds_left": max(0.0, x.expires_at - now),
                    "request_id": x.request_id,
                }
                for x in self._leases.values()
            ],
            "old_leases": dict(self._old_leases),
            "stored": [
                {
                    "version": s.version,
                    "seq": s.seq,
                    "group": base64.b64encode(wire.encode(s.group)).decode("ascii"),
                }
                for s in self._stored.values()
            ],
            "seen": dict(self._seen),
            "rejected_ids": {k: list(v) for k, v in self._rejected.items()},
            "counters": dict(c.values),
            "dropped": dict(c.dropped),
            "rejected": dict(c.rejected),
            "bad_messages": dict(c.bad_messages),
            "staleness_hist": {str(k): v for k, v in c.staleness_hist.items()},
            "data_states": dict(self._data_states),
            **({"depth": self.depth} if self.adaptive else {}),
        }

    def load_state_dict(
        self, state: dict[str, Any], *, now: float, nonce: str | None = None
    ) -> None:
        """Resume from :meth:`state_dict`. ``nonce`` (new per process) keeps new lease ids distinct
        from those granted by the process that crashed after the checkpoint."""
        try:
            if state.get("format") != STATE_FORMAT:
                raise ValueError(f"format {state.get('format')!r}, expected {STATE_FORMAT}")
            leases = {
                d["id"]: _Lease(
                    id=str(d["id"]),
                    worker_id=str(d["worker_id"]),
                    version=int(d["version"]),
                    k=int(d["k"]),
                    used=int(d["used"]),
                    expires_at=now + float(d["seconds_left"]),
                    request_id=str(d.get("request_id", "")),
                )
                for d in state["leases"]
            }
            stored: dict[str, _Stored] = {}
            for d in state["stored"]:
                g = wire.decode(base64.b64decode(d["group"]), expect=wire.Group)
                stored[g.id] = _Stored(group=g, version=int(d["version"]), seq=int(d["seq"]))
            counters = _Counters(
                values={**dict.fromkeys(_counter_names(), 0), **state["counters"]},
                dropped=dict(state["dropped"]),
                rejected=dict(state["rejected"]),
                bad_messages=dict(state["bad_messages"]),
                staleness_hist={int(k): int(v) for k, v in state["staleness_hist"].items()},
            )
            version = int(state["version"])
            lease_seq, seq = int(state["lease_seq"]), int(state["seq"])
            old_leases = {str(k): int(v) for k, v in state["old_leases"].items()}
            seen = {str(k): int(v) for k, v in state["seen"].items()}
            rejected_ids = {str(k): (int(v), str(r)) for k, (v, r) in state["rejected_ids"].items()}
            data_states = {str(k): dict(v) for k, v in state.get("data_states", {}).items()}
            depth = int(state.get("depth", 1))
        except (KeyError, TypeError, ValueError, wire.WireError) as e:
            raise ValueError(f"buffer state: cannot restore: {type(e).__name__}: {e}") from None
        self._version, self._lease_seq, self._seq = version, lease_seq, seq
        self._leases, self._old_leases, self._seen = leases, old_leases, seen
        self._rejected = rejected_ids
        self._data_states = data_states
        if self.adaptive:
            self._depth = max(1, depth)
        self._stored = stored
        self._heap = [(s.version, s.seq, gid) for gid, s in stored.items()]
        heapq.heapify(self._heap)
        self._c = counters
        self._now = now
        if nonce is not None:
            self._nonce = nonce
        self._drop_stale()  # in case the recipe's max_staleness shrank since the checkpoint

    @classmethod
    def from_state(
        cls, cfg: BufferConfig, state: dict[str, Any], *, now: float, nonce: str = "L"
    ) -> ReplayStore:
        store = cls(cfg, nonce=nonce)
        store.load_state_dict(state, now=now, nonce=nonce)
        return store


def _starts_held(leases: Any) -> dict[str, int]:
    """Worker id -> starts its live leases still hold (granted, not yet used or released)."""
    held: dict[str, int] = {}
    for x in leases:
        held[x.worker_id] = held.get(x.worker_id, 0) + x.remaining
    return held
