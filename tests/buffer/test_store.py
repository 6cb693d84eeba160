"""The replay store's accounting: staleness bound, exactly-once delivery, no capacity leak, resume.

Property tests drive the pure store with random schedules of acquire / start / put / resend /
release / clock / batch / version / checkpoint-restore / crash-to-older-checkpoint and check, after
every step, the bound and the books; deterministic tests pin the behaviours the anchors got wrong.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import event as hypothesis_event
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from asyncrl import wire
from asyncrl.buffer.store import ReplayStore
from asyncrl.recipe import BufferConfig


def make_group(
    gid: str,
    lease_id: str,
    *,
    versions: list[int],
    rewards: list[float] | None = None,
    tokens: int = 3,
    prompt: int = 2,
    finish_reason: str = "stop",
) -> wire.Group:
    """A group with one sample per entry of ``versions`` (all of that sample's tokens at it)."""
    rewards = rewards if rewards is not None else [float(i) for i in range(len(versions))]
    return wire.Group(
        id=gid,
        lease_id=lease_id,
        samples=[
            wire.Sample(
                id=f"{gid}/{i}",
                group_id=gid,
                prompt_ids=np.arange(prompt, dtype=np.int32),
                completion_ids=np.arange(tokens, dtype=np.int32) + 7,
                behavior_logprobs=np.full(tokens, -0.5, dtype=np.float32),
                versions=np.full(tokens, v, dtype=np.int32),
                loss_mask=np.ones(tokens, dtype=np.float32),
                reward=r,
                finish_reason=finish_reason,
            )
            for i, (v, r) in enumerate(zip(versions, rewards, strict=True))
        ],
    )


def note(text: str) -> None:
    """Count what the schedules reached (``--hypothesis-show-statistics``)."""
    if currently_in_test_context():
        hypothesis_event(text)


def cfg(**kw) -> BufferConfig:
    # a fixed depth (eta + 1, or max_batches_ahead) unless a test asks for an adaptive one: these
    # tests count starts against it
    base = dict(groups_per_batch=2, max_staleness=1, lease_seconds=10.0, adaptive_depth_wait=False)
    return BufferConfig(**{**base, **kw})


def roundtrip(store: ReplayStore, now: float, nonce: str) -> ReplayStore:
    """Checkpoint and restore through JSON text, as a learner would."""
    state = json.loads(json.dumps(store.state_dict()))
    return ReplayStore.from_state(store.cfg, state, now=now, nonce=nonce)


def test_max_batches_ahead_caps_the_pipeline_not_the_bound():
    """eta 4 admits 5 batches ahead (AReaL); max_batches_ahead 2 admits 2, and its groups are
    still accepted at any staleness up to 4."""
    assert ReplayStore(cfg(max_staleness=4), nonce="a").capacity == 5 * 2
    store = ReplayStore(cfg(max_staleness=4, max_batches_ahead=2), nonce="b")
    grant = store.acquire("w", 10, now=0.0, request_id="r1")
    assert grant.starts == 2 * 2 and store.capacity == 0
    for v in range(1, 4):  # the learner moves on without these groups' batch
        store.set_version(v)
    g = make_group("g0", grant.lease_id, versions=[0, 0])
    assert store.put([g], now=1.0).group_ids == ["g0"]  # staleness 3 <= 4: kept


def test_adaptive_depth_follows_the_drift_and_the_bound_stays():
    """eta 4, 2 groups a batch, adaptive on ESS < 0.9 or KL > 0.05: the depth starts at 1 batch,
    grows one a calm step up to eta + 1 = 5, shrinks one a step while ESS or KL says the policy
    moves fast, and admission follows it; a group started under the deeper pipeline is still
    trained at staleness 4 and dropped at 5, as without it."""
    store = ReplayStore(
        cfg(max_staleness=4, adaptive_depth_ess=0.9, adaptive_depth_kl=0.05), nonce="a"
    )
    assert store.depth == 1 and store.capacity == 2
    depths = [store.adapt_depth(ess, kl) for ess, kl in [(0.99, 0.0)] * 5]
    assert depths == [2, 3, 4, 5, 5] and store.capacity == 5 * 2
    grant = store.acquire("w", 10, now=0.0, request_id="r1")
    assert grant.starts == 10 and store.capacity == 0
    assert store.adapt_depth(0.5, 0.0) == 4  # ESS low
    assert store.adapt_depth(0.99, 0.2) == 3  # KL high
    assert [store.adapt_depth(0.5, None) for _ in range(3)] == [2, 1, 1]
    assert store.stats()["depth"] == 1
    # the 10 starts in flight stay valid; no new start until fewer than 1 batch wait or run
    assert store.acquire("w", 4, now=0.1, request_id="r2").starts == 0
    for v in range(1, 5):
        store.set_version(v)
    g = make_group("g0", grant.lease_id, versions=[0, 0])
    assert store.put([g], now=1.0).group_ids == ["g0"]  # staleness 4: kept
    h = make_group("g1", grant.lease_id, versions=[0, 0])
    store.put([h], now=1.1)
    batch = store.take_batch(1.2)
    assert batch is not None and batch.stats["staleness_max"] == 4 and batch.stats["depth"] == 1
    store.set_version(5)
    late = make_group("g2", grant.lease_id, versions=[0, 0])
    assert "stale" in store.put([late], now=1.3).rejected["g2"]  # staleness 5 > eta: never trained
    # the depth is checkpointed
    assert roundtrip(store, 2.0, "b").depth == 1
    # off (the default): the configured depth, and no depth in the stats
    plain = ReplayStore(cfg(max_staleness=4), nonce="c")
    assert plain.adapt_depth(0.1, 9.0) == 5 and "depth" not in plain.stats()


def _staleness_of(batch) -> list[int]:
    return [int(k) for k, n in batch.stats["staleness_hist"].items() for _ in range(n)]


def test_wait_driven_depth_deepens_only_where_the_learner_waits_on_the_depth():
    """adaptive_depth_wait, eta 4, 2 groups a batch. A generator that keeps up (the batch is
    stored before the learner asks) holds the depth at 1 batch: the freshest data that still
    overlaps. A learner that waits while the depth (not the bound) refuses a worker's starts
    deepens it one batch per such batch; a further whole batch already stored when one is taken
    makes it one shallower. The first batch (the pipeline filling) moves nothing."""
    store = ReplayStore(cfg(max_staleness=4, adaptive_depth_wait=True), nonce="w")
    n = iter(range(1000))

    def produce(k: int, now: float) -> int:
        """A worker asks for k starts and finishes every one granted at once."""
        grant = store.acquire("w", k, now=now, request_id=f"r{next(n)}")
        groups = [
            make_group(f"g{next(n)}", grant.lease_id, versions=[store.version] * 2)
            for _ in range(grant.starts)
        ]
        store.put(groups, now=now)
        return grant.starts

    def step(now: float) -> None:
        assert store.take_batch(now) is not None
        store.set_version(store.version + 1)

    # the first batch: the learner waits and the depth refuses starts, but the pipeline is filling
    assert store.take_batch(0.0) is None
    assert produce(4, 0.1) == 2  # depth 1 = 2 groups: 2 of 4 refused
    step(0.2)
    assert store.depth == 1
    # a generator that keeps up: the batch is there before the learner asks; depth stays 1
    for t in range(1, 6):
        assert produce(4, t) == 2
        step(t + 0.5)
        assert store.depth == 1
    # the learner asks first, waits; the worker is refused starts by the depth: one deeper
    assert store.take_batch(10.0) is None
    assert produce(4, 10.1) == 2
    step(10.2)
    assert store.depth == 2
    # waiting without a refusal (the worker asked for no more than the depth gives): unchanged
    assert store.take_batch(11.0) is None
    assert produce(2, 11.1) == 2
    step(11.2)
    assert store.depth == 2
    # two batches stored before the learner asks: a whole batch still stored after one is taken
    assert produce(4, 12.0) == 4
    step(12.1)
    assert store.depth == 1 and "depth" in store.stats()
    assert roundtrip(store, 13.0, "w2").depth == 1


def _wait_depth_trace(eta: int, schedule: list[tuple[int, bool, int]]) -> list[tuple]:
    """One worker and the learner on ``schedule``, a tick per entry (ask for k starts, whether the
    learner asks before the worker acts, how many running groups finish): per tick the starts
    granted, the depth and the batch taken, up to the first tick at which a running or stored
    group is more than 4 versions old (where eta 4's bound would act)."""
    store = ReplayStore(
        cfg(max_staleness=eta, adaptive_depth_wait=True, lease_seconds=1e6), nonce="w"
    )
    running: list[tuple[str, str, int]] = []  # (group id, lease id, version started at)
    stored: dict[str, int] = {}
    trace: list[tuple] = []
    n = 0

    def learner(now: float) -> list[str] | None:
        batch = store.take_batch(now)
        if batch is None:
            return None
        store.set_version(store.version + 1)
        for g in batch.groups:
            del stored[g.id]
        return [g.id for g in batch.groups]

    for t, (ask, learner_first, finish) in enumerate(schedule):
        oldest = min([v for *_, v in running] + list(stored.values()), default=store.version)
        if store.version - oldest > 4:
            break
        taken = learner(t) if learner_first else None
        grant = store.acquire("w", ask, now=t + 0.1, request_id=f"r{t}") if ask else None
        for _ in range(grant.starts if grant else 0):
            running.append((f"g{n}", grant.lease_id, store.version))
            n += 1
        done, running = running[:finish], running[finish:]
        groups = [make_group(gid, lid, versions=[v, v]) for gid, lid, v in done]
        assert not store.put(groups, now=t + 0.2).rejected
        stored |= {gid: v for gid, _, v in done}
        if taken is None:
            taken = learner(t + 0.3)
        trace.append((grant.starts if grant else 0, store.depth, taken))
    return trace


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 6), st.booleans(), st.integers(0, 6)), min_size=1, max_size=40
    )
)
def test_the_wait_driven_depth_at_eta_16_is_eta_4s_until_a_group_ages_past_4(schedule):
    """Under adaptive_depth_wait the bound enters only where a group would age past it: with
    eta 4 and eta 16 the store grants the same starts, keeps the same depth and hands out the
    same batches on any schedule until a group is more than 4 versions old. So the hard-start
    bench's eta16-wait runs, whose groups never aged past 4, ran eta4-wait's pipeline
    (BENCHMARKS.md, Session 24)."""
    t16 = _wait_depth_trace(16, schedule)
    note("a group aged past 4" if len(t16) < len(schedule) else "no group aged past 4")
    note(f"deepest {max((d for _, d, _ in t16), default=1)}")
    assert _wait_depth_trace(4, schedule)[: len(t16)] == t16


def test_newest_order_takes_the_freshest_and_the_stale_age_out():
    """eta 2, 2 groups a batch, batch_order newest: a batch takes the two freshest stored groups
    (first come within a version), the older ones wait, and one past eta is dropped as stale and
    its start returned, where the oldest order would have trained it."""
    store = ReplayStore(cfg(max_staleness=2, batch_order="newest"), nonce="a")
    leases = {}
    for v in range(3):
        store.set_version(v)
        leases[v] = store.acquire("w", 2, now=0, request_id=f"r{v}").lease_id
    for gid, v in [("a0", 0), ("b0", 0), ("a2", 2), ("a1", 1), ("b2", 2)]:
        store.put([make_group(gid, leases[v], versions=[v])], now=0)
    batch = store.take_batch(0)
    assert [g.id for g in batch.groups] == ["a2", "b2"] and _staleness_of(batch) == [0, 0]
    assert store.stored_ids() == ["a0", "b0", "a1"]
    store.set_version(3)  # a0, b0 are now 3 versions old: dropped, their starts returned
    assert store.take_batch(0) is None  # only a1 is left
    assert store.stats()["dropped"] == {"stale": 2} and store.stored_ids() == ["a1"]
    store.put([make_group("a3", store.acquire("w", 1, now=0).lease_id, versions=[3])], now=0)
    assert store.take_batch(0).stats["dropped_stale"] == 2  # logged as buffer/dropped_stale


# --------------------------------------------------------------------------------------------------
# Property tests
# --------------------------------------------------------------------------------------------------


class StoreMachine(RuleBasedStateMachine):
    """Workers, a learner and crashes against one store; the model is what the workers know."""

    @initialize(
        b=st.integers(1, 3),
        eta=st.integers(0, 2),
        dynamic=st.booleans(),
        fill=st.sampled_from([1.0, 0.5]),
        ahead=st.integers(0, 2),
        adaptive=st.sampled_from(["", "ess", "wait"]),
        newest=st.booleans(),
    )
    def setup(
        self,
        b: int,
        eta: int,
        dynamic: bool,
        fill: float,
        ahead: int,
        adaptive: str = "",
        newest: bool = False,
    ) -> None:
        self.cfg = cfg(
            groups_per_batch=b,
            max_staleness=eta,
            dynamic_sampling=dynamic,
            min_batch_fill=fill,
            max_batches_ahead=ahead,
            adaptive_depth_ess=0.9 if adaptive == "ess" else 0.0,
            adaptive_depth_wait=adaptive == "wait",
            batch_order="newest" if newest else "oldest",
        )
        self.store = ReplayStore(self.cfg, nonce="n0")
        self.now = 0.0
        self.incarnation = 0
        self.leases: dict[str, dict] = {}  # lease id -> {"version", "left"} as the worker sees it
        self.running: list[tuple[str, str, int]] = []  # (group id, lease id, lease version)
        self.sent: dict[str, wire.Group] = {}  # put at least once, still held by a worker
        self.info: dict[str, dict] = {}  # group id -> {"lease_version", "oldest", "equal"}
        self.acked: set[str] = set()
        self.handed: set[str] = set()
        self.snapshot: tuple | None = None
        self.n = 0
        self.requests = 0

    # -- workers ----------------------------------------------------------------------------------

    @rule(n=st.integers(0, 4), hold=st.integers(0, 2))
    def acquire(self, n: int, hold: int) -> None:
        """A worker asks for starts and starts all but ``hold`` of those granted at once."""
        self.requests += 1
        grant = self.store.acquire("w", n, now=self.now, request_id=f"r{self.requests}")
        assert grant.version == self.store.version
        assert 0 <= grant.starts <= n
        if grant.starts:
            self.leases[grant.lease_id] = {"version": grant.version, "left": grant.starts}
            for _ in range(max(0, grant.starts - hold)):
                self._start(grant.lease_id)

    @precondition(lambda self: any(x["left"] for x in self.leases.values()))
    @rule(pick=st.integers(0, 99))
    def start(self, pick: int) -> None:
        """A held start is used later (perhaps after its lease expired)."""
        held = [k for k, x in self.leases.items() if x["left"]]
        self._start(held[pick % len(held)])

    def _start(self, lid: str) -> None:
        self.leases[lid]["left"] -= 1
        self.n += 1
        self.running.append((f"g{self.n}", lid, self.leases[lid]["version"]))

    @precondition(lambda self: self.running)
    @rule(seed=st.integers(0, 2**16), count=st.integers(1, 4))
    def finish(self, seed: int, count: int) -> None:
        """Groups complete (in any order) and are put in one message. Token versions lie between
        the grant's version and now, or, rarely, a buggy worker stamps a version from the future."""
        rng = random.Random(seed)
        groups = []
        for _ in range(min(count, len(self.running))):
            gid, lid, lv = self.running.pop(rng.randrange(len(self.running)))
            hi = max(lv, self.store.version) + int(rng.random() < 0.05)
            versions = [rng.randint(lv, hi) for _ in range(2)]
            equal = rng.random() < 0.25
            g = make_group(gid, lid, versions=versions, rewards=[1.0, 1.0 if equal else 0.0])
            self.info[gid] = {"lease_version": lv, "oldest": min(versions), "equal": equal}
            self.sent[gid] = g
            groups.append(g)
        self._put(groups, resend=False)

    @precondition(lambda self: self.sent)
    @rule(pick=st.integers(0, 999))
    def resend(self, pick: int) -> None:
        """The worker did not hear the reply and sends the same group again."""
        gid = sorted(self.sent)[pick % len(self.sent)]
        self._put([self.sent[gid]], resend=True)

    def _put(self, groups: list[wire.Group], *, resend: bool) -> None:
        was = {g.id: g.id in self.acked for g in groups}
        ack = self.store.put(groups, now=self.now)
        assert ack.version == self.store.version
        assert sorted([*ack.group_ids, *ack.rejected]) == sorted(was)
        for g in groups:
            self._check_answer(g, ack, was_acked=was[g.id], resend=resend)

    def _check_answer(self, g: wire.Group, ack: wire.Ack, *, was_acked: bool, resend: bool) -> None:
        info = self.info[g.id]
        if g.id in ack.group_ids:
            assert g.id not in ack.rejected
            # Nothing newer than the learner, nothing too old, is ever accepted.
            newest = max(int(s.versions.max()) for s in g.samples)
            assert newest <= self.store.version
            if not was_acked:
                assert min(info["oldest"], info["lease_version"]) >= self.store.min_version
            self.acked.add(g.id)
        else:
            reason = ack.rejected[g.id]
            code = reason.split(":", 1)[0]
            note(f"rejected {code}")
            assert code in {"stale", "unknown_lease", "future_version", "lease_expired"}, reason
            if was_acked:  # forgotten only once it can no longer be trained on
                assert resend and code in {"stale", "unknown_lease"}, reason
                assert info["oldest"] < self.store.min_version
            if code == "stale":
                assert min(info["oldest"], info["lease_version"]) < self.store.min_version

    @precondition(lambda self: any(x["left"] for x in self.leases.values()))
    @rule(pick=st.integers(0, 99), n=st.integers(1, 3))
    def release(self, pick: int, n: int) -> None:
        held = [k for k, x in self.leases.items() if x["left"]]
        lid = held[pick % len(held)]
        left = self.leases[lid]["left"]
        self.store.expire(self.now)  # as release does first: the counters below see only it
        before = self.store.stats()
        reply = self.store.release(lid, n, now=self.now)
        after = self.store.stats()
        freed = after["released"] - before["released"]
        if isinstance(reply, wire.Error):  # a lease granted after the checkpoint a crash rewound to
            assert reply.code == "unknown_lease" and lid in reply.message, reply
            assert after == before
        else:
            assert reply.version == self.store.version
            if "already closed" in reply.message:  # expired or closed stale: nothing to give back
                assert freed == 0
            else:  # a live lease gives back all the worker holds (its started groups keep their
                # starts until they arrive), never more than asked
                assert reply.message == f"released {freed}"
                assert min(n, left) <= freed <= n
            assert after["grants_in_flight"] == before["grants_in_flight"] - freed
            assert after["started"] == before["started"] - freed
        self.leases[lid]["left"] -= min(n, left)

    @rule(dt=st.sampled_from([0.5, 3.0, 11.0]))
    def tick(self, dt: float) -> None:
        self.now += dt

    # -- learner ----------------------------------------------------------------------------------

    @rule(partial=st.booleans())
    def train_step(self, partial: bool) -> None:
        depth = self.store.depth
        batch = self.store.take_batch(self.now, allow_partial=partial)
        # adaptive_depth_wait moves the depth only as a batch is taken, by one, within 1 ... max
        assert 1 <= self.store.depth <= self.store.max_depth
        if batch is None or not self.cfg.adaptive_depth_wait:
            assert self.store.depth == depth
        else:
            assert abs(self.store.depth - depth) <= 1
        if batch is None:
            return
        b = self.cfg.groups_per_batch
        assert len(batch.groups) == b or (partial and len(batch.groups) >= b * 0.5)
        assert batch.version == self.store.version
        for g in batch.groups:
            assert g.id in self.acked, "handed out a group that was never acknowledged"
            assert g.id not in self.handed, "handed out a group twice"
            info = self.info[g.id]
            # Staleness against the version the group was started at, and against every token.
            assert batch.version - info["lease_version"] <= self.cfg.max_staleness
            assert batch.version - info["oldest"] <= self.cfg.max_staleness
            if self.cfg.dynamic_sampling:
                assert not info["equal"]
            self.handed.add(g.id)
        assert batch.stats["staleness_max"] <= self.cfg.max_staleness
        # the order: no group left behind is fresher (newest) or older (oldest) than one taken
        behaviour = {g: min(i["lease_version"], i["oldest"]) for g, i in self.info.items()}
        taken = [behaviour[g.id] for g in batch.groups]
        left = [behaviour[gid] for gid in self.store.stored_ids()]
        if left and self.cfg.batch_order == "newest":
            assert max(left) <= min(taken)
        elif left:
            assert min(left) >= max(taken)
        note(f"batch with staleness {batch.stats['staleness_max']}")
        self.store.set_version(self.store.version + 1)  # the optimizer step

    @rule(ess=st.sampled_from([0.5, 0.95]))
    def adapt(self, ess: float) -> None:
        """The learner's ESS moves the adaptive depth (nothing when it is off): one batch a
        step, between 1 and the configured depth; the staleness checks of train_step hold."""
        before = self.store.depth
        after = self.store.adapt_depth(ess, None)
        assert after == self.store.depth and 1 <= after <= self.store.max_depth
        if self.cfg.adaptive_depth_wait:  # the waits deepen it; a low ESS would still lower it
            assert after == before
        elif self.store.adaptive:
            assert after == (
                max(1, before - 1) if ess < 0.9 else min(self.store.max_depth, before + 1)
            )

    @rule()
    def bump_version(self) -> None:
        """A version change without a batch (e.g. weights reloaded): only widens admission."""
        self.store.set_version(self.store.version + 1)

    # -- checkpoints ------------------------------------------------------------------------------

    @rule()
    def checkpoint_restore(self) -> None:
        """Save and resume at once (clean restart): nothing changes, nothing is lost."""
        before = self.store.stats()
        self.incarnation += 1
        self.store = roundtrip(self.store, self.now, f"n{self.incarnation}")
        assert self.store.stats() == before

    @rule()
    def take_snapshot(self) -> None:
        self.snapshot = (
            json.dumps(self.store.state_dict()),
            set(self.acked),
            set(self.handed),
        )

    @precondition(lambda self: self.snapshot is not None)
    @rule()
    def crash_restore(self) -> None:
        """The learner dies and resumes from its last checkpoint. Groups acknowledged after it are
        gone with the learner's memory (their workers dropped them once acked), so the books rewind
        to the checkpoint; workers keep their leases and in-flight groups and learn from the
        rejections that those leases and versions no longer exist."""
        state, acked, handed = self.snapshot
        self.incarnation += 1
        self.store = ReplayStore.from_state(
            self.cfg, json.loads(state), now=self.now, nonce=f"n{self.incarnation}"
        )
        note(f"crash lost {min(len(self.acked - acked), 2)}+ acked groups")
        for gid in self.acked - acked:
            self.sent.pop(gid, None)
        self.acked, self.handed = set(acked), set(handed)

    # -- the books --------------------------------------------------------------------------------

    @invariant()
    def bound_holds(self) -> None:
        if not hasattr(self, "store"):
            return
        s = self.store
        assert s.started <= s.bound
        st_ = s.stats()
        # Every start granted is in exactly one place.
        assert st_["granted"] == (
            st_["arrived"]
            + st_["released"]
            + st_["expired"]
            + st_["closed_stale"]
            + st_["grants_in_flight"]
        )

    @invariant()
    def nothing_lost_or_twice(self) -> None:
        """Acknowledged = handed out once + stored + dropped (counted, for a stated reason)."""
        if not hasattr(self, "store"):
            return
        s = self.store
        stored = set(s.stored_ids())
        assert s.stats()["consumed"] == len(self.handed)
        assert stored <= self.acked - self.handed
        missing = self.acked - self.handed - stored
        assert len(missing) == sum(s.stats()["dropped"].values())
        for gid in missing:
            info = self.info[gid]
            too_old = min(info["oldest"], info["lease_version"]) < s.min_version
            assert too_old or (self.cfg.dynamic_sampling and info["equal"]), gid

    def teardown(self) -> None:
        """After every lease expires, the slots in use are exactly consumed + stored: no leak."""
        if not hasattr(self, "store"):
            return
        s = self.store
        s.expire(self.now + self.cfg.lease_seconds + 1)
        assert s.in_flight == 0
        assert s.started == len(self.handed) + len(s.stored_ids())
        batches = self.cfg.max_staleness + 1
        if self.cfg.max_batches_ahead:
            batches = min(batches, self.cfg.max_batches_ahead)
        assert s.depth == batches or (s.adaptive and 1 <= s.depth <= batches)
        depth = s.depth * self.cfg.groups_per_batch - len(s.stored_ids())
        assert s.capacity == max(0, min(s.bound - s.started, depth))


StoreMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStoreMachine = StoreMachine.TestCase


@pytest.mark.parametrize("seed", range(24))
def test_long_random_schedules(seed: int) -> None:
    """The same machine over long seeded schedules shaped like a run (workers keep the pipeline
    full, the learner trains whenever it can), reaching many versions, restores and drops; the
    hypothesis runs above are shorter but shrink failures."""
    rng = random.Random(seed)
    m = StoreMachine()
    m.setup(
        b=rng.randint(1, 4),
        eta=seed % 3,
        dynamic=seed % 2 == 0,
        fill=[1.0, 0.5][seed % 4 // 2],
        ahead=seed // 8,  # 0 (eta + 1), 1, 2
        adaptive=["ess", "ess", "wait", "", ""][seed % 5],
        newest=seed % 3 == 1,
    )
    rules = [
        (lambda: m.acquire(rng.randint(1, 4), rng.choice([0, 0, 0, 1])), 6),
        (lambda: m.start(rng.randrange(99)), 1),
        (lambda: m.finish(rng.randrange(2**16), rng.randint(1, 4)), 6),
        (lambda: m.resend(rng.randrange(999)), 1),
        (lambda: m.release(rng.randrange(99), rng.randint(1, 3)), 1),
        (lambda: m.tick(rng.choice([0.5, 0.5, 3.0, 11.0])), 2),
        (lambda: m.train_step(rng.random() < 0.3), 4),
        (lambda: m.bump_version(), 0.2),
        (lambda: m.checkpoint_restore(), 0.3),
        (lambda: m.take_snapshot(), 0.3),
        (lambda: m.crash_restore(), 0.2),
        (lambda: m.adapt(rng.choice([0.5, 0.95])), 1),
    ]
    preconditions = {1: "leases", 2: "running", 3: "sent", 4: "leases", 10: "snapshot"}
    for _ in range(1500):
        i = rng.choices(range(len(rules)), weights=[w for _, w in rules])[0]
        need = preconditions.get(i)
        if need == "leases" and not any(x["left"] for x in m.leases.values()):
            continue
        if need and need != "leases" and not getattr(m, need):
            continue
        rules[i][0]()
        m.bound_holds()
        m.nothing_lost_or_twice()
    m.teardown()
    stats = m.store.stats()
    assert stats["version"] >= 5 and stats["batches"] >= 5  # the schedule did train


# --------------------------------------------------------------------------------------------------
# Deterministic tests
# --------------------------------------------------------------------------------------------------


def test_max_staleness_zero_is_synchronous() -> None:
    """eta = 0: batch k holds only groups started at version k; B starts per version, never more;
    a worker that dies or a group dropped by dynamic sampling does not deadlock the loop."""
    b = 4
    store = ReplayStore(cfg(groups_per_batch=b, max_staleness=0, dynamic_sampling=True))
    rng = random.Random(0)
    now, n = 0.0, 0

    def groups_for(lid: str, count: int, k: int) -> list[wire.Group]:
        nonlocal n
        n += count
        return [make_group(f"g{n - i}", lid, versions=[k, k]) for i in range(count)]

    for k in range(9):
        g1 = store.acquire("w1", 3, now=now)
        g2 = store.acquire("w2", 3, now=now)
        assert (g1.starts, g2.starts, g1.version, g2.version) == (3, 1, k, k)
        assert store.acquire("w3", 1, now=now).starts == 0  # at the bound: wait for the version
        groups = groups_for(g1.lease_id, 3, k)
        if k % 3 == 1:  # worker 2 dies: its lease expires, its start comes back to a new worker
            assert store.put(groups, now=now).group_ids == [g.id for g in groups]
            now += store.cfg.lease_seconds
            g2 = store.acquire("w3", 5, now=now)
            assert (g2.starts, g2.version) == (1, k)
            groups = []
        groups += groups_for(g2.lease_id, 1, k)
        if k % 3 == 2:  # equal rewards: dropped, and the slot is freed for a replacement
            groups[0].samples[1].reward = groups[0].samples[0].reward
        rng.shuffle(groups)
        ack = store.put(groups, now=now)
        assert sorted(ack.group_ids) == sorted(g.id for g in groups) and not ack.rejected
        if k % 3 == 2:
            assert store.take_batch(now) is None
            r = store.acquire("w1", 2, now=now)
            assert (r.starts, r.version) == (1, k)
            store.put(groups_for(r.lease_id, 1, k), now=now)
        batch = store.take_batch(now)
        assert batch is not None and batch.version == k and len(batch.groups) == b
        assert all(s.behavior_version == k for g in batch.groups for s in g.samples)
        assert batch.stats["staleness_max"] == 0
        assert store.acquire("w1", 1, now=now).starts == 0  # batch taken, version not yet bumped
        store.set_version(k + 1)
    assert store.stats()["dropped"] == {"equal_rewards": 3}
    assert store.stats()["expired"] == 3


def test_late_group_dropped_not_trained_at_bound_zero() -> None:
    """eta = 0: a straggler from version k that arrives at k+1 is rejected, its slot comes back."""
    store = ReplayStore(cfg(groups_per_batch=2, max_staleness=0))
    g = store.acquire("w", 2, now=0)
    store.put([make_group("a", g.lease_id, versions=[0, 0])], now=0)
    store.release(g.lease_id, 0, now=0)
    assert store.take_batch(0, allow_partial=True) is None  # min_batch_fill = 1
    store.set_version(1)  # e.g. a weight reload: `a` is now too old
    assert store.stats()["dropped"] == {"stale": 1}
    ack = store.put([make_group("b", g.lease_id, versions=[0, 0])], now=0)
    assert ack.rejected["b"].startswith("stale:")
    assert store.capacity == 2  # everything from version 0 gave its slot back


def test_restore_keeps_the_bound_and_the_data() -> None:
    """AReaL#1388: after a restart, admission continues where it was instead of starting afresh;
    stored groups survive, consumed ones are not served again, old leases still count."""
    store = ReplayStore(cfg(groups_per_batch=2, max_staleness=1), nonce="a")
    l1 = store.acquire("w", 4, now=0)
    assert l1.starts == 4 and store.capacity == 0
    store.put([make_group(f"g{i}", l1.lease_id, versions=[0, 0]) for i in range(3)], now=0)
    first = store.take_batch(0)
    assert [g.id for g in first.groups] == ["g0", "g1"]
    store.set_version(1)

    restored = roundtrip(store, now=1000.0, nonce="b")
    assert restored.version == 1 and restored.capacity == 2  # (1+1+1)*2 - (2 + 1 + 1 in flight)
    assert restored.stored_ids() == ["g2"]
    ack = restored.put([make_group("g0", l1.lease_id, versions=[0, 0])], now=1000.0)
    assert ack.group_ids == ["g0"]  # a resend of a consumed group: acknowledged, ignored
    l2 = restored.acquire("w", 9, now=1000.0)
    assert l2.starts == 2 and l2.lease_id.startswith("b-")  # new ids cannot collide with old ones
    restored.put([make_group("g3", l1.lease_id, versions=[0, 1])], now=1000.0)  # the old lease
    second = restored.take_batch(1000.0)
    assert [g.id for g in second.groups] == ["g2", "g3"]
    # The restored lease's clock restarted from its seconds left, not from another process' time.
    restored.expire(1000.0 + 10.0)
    assert restored.in_flight == 0


def test_resent_acquire_gets_the_same_lease() -> None:
    store = ReplayStore(cfg(groups_per_batch=2, max_staleness=0, lease_seconds=5.0))
    first = store.acquire("w", 2, now=0, request_id="r1")
    again = store.acquire("w", 2, now=1, request_id="r1")
    assert (again.lease_id, again.starts, again.request_id) == (first.lease_id, 2, "r1")
    assert again.lease_seconds == 4.0
    assert store.acquire("other", 2, now=1, request_id="r1").starts == 0  # another worker's id
    assert store.stats()["granted"] == 2
    store.expire(5.0)
    assert store.acquire("w", 2, now=5, request_id="r1").lease_id != first.lease_id


def test_put_validation_reasons() -> None:
    store = ReplayStore(cfg(groups_per_batch=2, max_staleness=1, lease_seconds=5.0))
    g = store.acquire("w", 1, now=0)
    ack = store.put(
        [
            make_group("nolease", "bogus", versions=[0]),
            make_group("future", g.lease_id, versions=[3]),
            make_group("empty", g.lease_id, versions=[0], tokens=0),
        ],
        now=0,
    )
    assert ack.group_ids == []
    assert ack.rejected["nolease"].startswith("unknown_lease:")
    assert ack.rejected["future"].startswith("future_version:")
    assert ack.rejected["empty"].startswith("empty:")
    # A resent rejected group gets the same answer and is counted once.
    again = store.put([make_group("future", g.lease_id, versions=[3])], now=0)
    assert again.rejected == {"future": ack.rejected["future"]}
    assert store.stats()["rejected"] == {"unknown_lease": 1, "future_version": 1, "empty": 1}

    # A lease that expired: a late group is taken while capacity remains, refused at the bound.
    late = store.acquire("w", 2, now=0)
    store.expire(10.0)
    assert store.put([make_group("late", late.lease_id, versions=[0])], now=10).group_ids == [
        "late"
    ]
    assert store.stats()["late_accepted"] == 1
    assert (
        store.acquire("w", 3, now=10).starts == 3
    )  # the bound is now full: 1 stored + 3 in flight
    ack = store.put([make_group("late2", late.lease_id, versions=[0])], now=10)
    assert ack.rejected["late2"].startswith("lease_expired:")
    assert store.started <= store.bound


def test_overlong_filter_masks_and_keeps_group() -> None:
    store = ReplayStore(cfg(groups_per_batch=1, overlong_filter=True))
    g = store.acquire("w", 1, now=0)
    grp = make_group("g", g.lease_id, versions=[0, 0])
    grp.samples[1].finish_reason = "length"
    store.put([grp], now=0)
    batch = store.take_batch(0)
    s0, s1 = batch.groups[0].samples
    assert s0.loss_mask.sum() == 3 and s1.loss_mask.sum() == 0
    assert batch.stats["overlong_samples"] == 1 and len(batch.groups[0].samples) == 2


def test_partial_batches_and_fifo_order() -> None:
    store = ReplayStore(cfg(groups_per_batch=4, max_staleness=2, min_batch_fill=0.5))
    leases = {}
    for v in range(3):
        store.set_version(v)
        leases[v] = store.acquire("w", 2, now=0).lease_id
    store.put([make_group("v2", leases[2], versions=[2])], now=0)
    store.put([make_group("v1", leases[1], versions=[2])], now=0)  # started at 1: older
    store.put([make_group("v0", leases[0], versions=[0])], now=0)
    assert store.take_batch(0) is None  # 3 < 4
    batch = store.take_batch(0, allow_partial=True)
    assert [g.id for g in batch.groups] == ["v0", "v1", "v2"]  # oldest behaviour version first
    assert batch.stats["staleness_hist"] == {"0": 1, "1": 1, "2": 1}
    assert [batch.stats[f"staleness_hist/{k}"] for k in range(3)] == [1, 1, 1]
    store.put([make_group("x", leases[2], versions=[2])], now=0)
    assert store.take_batch(0, allow_partial=True) is None  # 1 < 0.5 * 4


def test_version_cannot_go_back_and_state_errors_are_clear() -> None:
    store = ReplayStore(cfg())
    store.set_version(3)
    with pytest.raises(ValueError, match="cannot go back"):
        store.set_version(2)
    with pytest.raises(ValueError, match="buffer state: cannot restore"):
        ReplayStore.from_state(cfg(), {"format": 1, "version": 0}, now=0)


@pytest.mark.parametrize("in_metadata", [False, True], ids=["field", "old-journal-metadata"])
def test_data_positions_survive_a_restore(in_metadata: bool):
    """The newest data position per worker rides along with the checkpoint (docs/design.md §6: a restart
    neither repeats nor skips prompts), and a duplicate resend does not move it back. Groups
    journalled before ``Group.data_state`` existed carry it in their metadata."""
    cfg = BufferConfig(groups_per_batch=2, max_staleness=1)
    store = ReplayStore(cfg)
    grant = store.acquire("w0", 3, now=0.0)

    def group(i: int, pos: int) -> wire.Group:
        g = make_group(f"g{i}", grant.lease_id, versions=[0, 0])
        g.metadata = {"worker_id": "w0"}
        if in_metadata:
            g.metadata["data_state"] = {"next": pos}
        else:
            g.data_state = {"next": pos}
        return g

    store.put([group(0, 1)], now=0.0)
    store.put([group(1, 2)], now=0.0)
    store.put([group(0, 1)], now=0.0)  # a resend of an older group
    assert store.stats()["data_states"] == {"w0": {"next": 2}}
    restored = ReplayStore.from_state(cfg, store.state_dict(), now=5.0)
    assert restored.stats()["data_states"] == {"w0": {"next": 2}}


def test_dynamic_sampling_keeps_equal_reward_groups_their_remax_baseline_differs_from() -> None:
    """Under ReMax a group whose rewards are all equal still has a signal when its greedy baseline
    differs (every advantage r − b is the same nonzero number); it is dropped only when that too
    is equal. Groups without a baseline are judged on their rewards alone, as before."""
    store = ReplayStore(cfg(groups_per_batch=4, dynamic_sampling=True))
    lease = store.acquire("w", 4, now=0).lease_id
    cases = {"differs": 0.0, "same": 1.0, "none": None, "one": 0.0}
    for gid, b in cases.items():
        g = make_group(gid, lease, versions=[0] if gid == "one" else [0, 0], rewards=None)
        for s in g.samples:
            s.reward = 1.0
        g.baseline_reward = b
        store.put([g], now=0)
    stored = set(store.stored_ids())
    assert stored == {"differs", "one"} and store.stats()["dropped"]["equal_rewards"] == 2
