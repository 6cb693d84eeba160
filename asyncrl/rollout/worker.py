"""The rollout worker: a trio nursery of named tasks feeding the learner's buffer (docs/design.md §2, §3, §6).

Before anything else every generator is labelled with the version of the weights it holds
(``GeneratorPool.label``). Tasks:
- ``register``: tells the learner which generators this worker drives (``wire.Register``), retried
  until acknowledged; a first registration refused because the learner cannot reach a generator
  ends the worker (:class:`GeneratorUnreachable`).
- ``versions``: hears version announcements (``wire.Version`` over Pub/Sub) and cancels groups that can
  no longer be trained within ``max_staleness``, giving their starts back (``wire.Release``).
- ``admission``: asks the buffer for the right to start groups (``wire.Acquire`` → ``wire.Grant``, a
  lease) and starts one ``group-*`` task per granted start, never more groups in flight than granted
  and never more than ``max_concurrent_groups``. It asks only while a generator holds weights within
  the bound (version ≥ learner version − ``max_staleness``): tokens of older weights could never be
  trained, so it waits for the broadcaster (e.g. a restarted worker's engines before they join).
  While it waits it asks the learner (``wire.Status``) which generators it sends no weights to;
  once the learner has said so of all of this worker's for ``dropped_limit_s`` on end, the worker
  stops with the learner's reasons (a learner that does not answer resets the count: a partition
  or a restart is waited out, not taken for a verdict).
- ``group-*``: one prompt → ``group_size`` episodes run concurrently by the workflow → rewards →
  one whole ``wire.Group`` (with ReMax, and one greedy episode whose reward is the group's baseline).
  An episode whose reward failed is left out of it; a group left with too few is dropped, its prompt
  counted as used (``groups_dropped_reward_failures``; :mod:`asyncrl.rollout.group_maker`).
- ``sender``: puts finished groups to the buffer (``wire.Put``, several per message), resending the
  SAME group ids until each is acknowledged or rejected: with the buffer's dedup by id, exactly once.
- ``metrics``: throughput, episodes in flight, generator idle fraction, reward, length, failures.
- ``generator-versions``: asks generators whose version is unknown or behind the bound (back from
  a restart, refused for unlabelled tokens) for it again (``/model_info``), once a second.

A group is "in flight" from the moment it takes a granted start until the buffer acknowledged or
rejected it, or it was cancelled and its start released (the accounting, pure:
:class:`~asyncrl.rollout.leases.LeaseBook`). A group whose lease expires while it is still generating
is cancelled too (the buffer has taken the start back). Making a group is
:class:`~asyncrl.rollout.group_maker.GroupMaker`; delivering it,
:class:`~asyncrl.rollout.buffer_sender.Sender`.

The worker runs until the learner ends the run (``wire.End`` on Pub/Sub, or a ``run_ended`` reply):
then it cancels what is in flight, gives the starts back and returns. A learner that goes away
without that is waited for (a restarted one reconnects this worker); the failing retries are logged
once a minute (:class:`~asyncrl.progress.Throttle`), not on every attempt.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from asyncrl import backoff, wire
from asyncrl import metric_names as names
from asyncrl.agents.tool_envs import ToolSet
from asyncrl.agents.tools import ToolRegistry
from asyncrl.buffer.client import BufferClient, BufferRefused
from asyncrl.contract import Workflow
from asyncrl.progress import Throttle
from asyncrl.rollout.buffer_sender import Sender
from asyncrl.rollout.generator_pool import GeneratorPool
from asyncrl.rollout.group_maker import GroupMaker, RewardsFailed
from asyncrl.rollout.leases import LeaseBook, Start
from asyncrl.rollout.prompts import PromptSource
from asyncrl.rollout.sglang_protocol import SamplingParams
from asyncrl.rollout.worker_config import WorkerConfig
from asyncrl.rollout.worker_stats import WorkerStats
from asyncrl.served.model_reward import Reward
from asyncrl.served.teacher import TeacherLogprobs
from asyncrl.transport import Subscriber, TransportTimeout

log = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """The worker cannot go on (e.g. every group fails); the text says why."""


class GeneratorUnreachable(WorkerError):
    """The learner refused this worker's first registration: it cannot reach one of its
    generators (``generator_unreachable``), so they would never get weights. A setting to fix
    (``generator.host``, ``generator.urls``), not a fault a restart cures."""


# --------------------------------------------------------------------------------------------------
# The worker
# --------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _GroupRun:
    gid: str
    start: Start
    scope: trio.CancelScope
    prompt_index: int = -1
    started_at: float = 0.0
    cancelled: str = ""  # why the worker cancelled it


class RolloutWorker:
    """Runs episodes into the buffer until cancelled (or until ``config.max_groups`` delivered)."""

    def __init__(
        self,
        config: WorkerConfig,
        *,
        buffer: BufferClient,
        pool: GeneratorPool,
        source: PromptSource,
        tokenizer: Any,
        workflow: Workflow,
        reward: Reward,
        params: SamplingParams,
        tools: ToolRegistry | ToolSet | None = None,
        max_turns: int = 1,
        subscriber: Subscriber | None = None,
        generators: list[wire.GeneratorInfo] | None = None,
        metrics: Any = None,  # asyncrl.metrics.MetricsSink
        teacher: TeacherLogprobs | None = None,
    ) -> None:
        self.cfg = config
        self.buffer = buffer
        self.pool = pool
        self.source = source
        self.subscriber = subscriber
        self.generators = generators or []
        self.metrics = metrics
        self.leases = LeaseBook()
        self.stats = WorkerStats(leases=self.leases)
        self.version = 0
        self.ended: wire.End | None = None  # the learner's end-of-run announcement, once heard
        self.registered = trio.Event()
        self._quiet = Throttle(log)  # retries of an unreachable learner: a line a minute
        self._nonce = uuid.uuid4().hex[:8]  # group ids stay unique across restarts of a worker
        self._seq = 0
        self._runs: dict[str, _GroupRun] = {}  # the groups being made, by id
        self._consecutive_failures = 0
        self._changed = trio.Event()  # something freed capacity or the version moved
        self._done = trio.Event()
        self.groups = GroupMaker(
            config,
            pool=pool,
            source=source,
            tokenizer=tokenizer,
            workflow=workflow,
            reward=reward,
            params=params,
            tools=tools.registry if isinstance(tools, ToolSet) else tools or ToolRegistry([]),
            tool_set=tools if isinstance(tools, ToolSet) else None,
            max_turns=max_turns,
            stats=self.stats,
            teacher=teacher,
        )
        self.sender = Sender(
            buffer=buffer,
            source=source,
            stats=self.stats,
            worker_id=config.worker_id,
            put_batch=config.put_batch,
            acked_log=config.acked_log,
            quiet=self._quiet,
            retry_sleep=self._retry_sleep,
            settled=self._settled,
            saw_version=self._see_version,
        )
        self._t_last = 0.0
        self._prev = dict(self.stats.counters)
        self._registering = False
        self._dropped_since: float | None = None  # the learner says it drops all our generators

    # -- public ----------------------------------------------------------------------------------

    @property
    def groups_in_flight(self) -> int:
        return self.leases.in_flight

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> WorkerStats:
        """Run until cancelled or ``max_groups`` delivered; returns the counters.

        First every generator is labelled with the version it holds (:meth:`GeneratorPool.label`),
        before it is registered with the learner: no weight broadcast can race the label."""
        await self.pool.label()
        self._t_last = trio.current_time()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._register_loop, name="register")
                if self.subscriber is not None:
                    nursery.start_soon(self._version_loop, name="versions")
                nursery.start_soon(self._admission_loop, name="admission")
                nursery.start_soon(self.sender.run, name="sender")
                nursery.start_soon(self._metrics_loop, name="metrics")
                nursery.start_soon(self._generator_versions_loop, name="generator-versions")
                task_status.started()
                await self._done.wait()
                nursery.cancel_scope.cancel()
        finally:
            bound = self.cfg.end_release_s if self.ended else self.cfg.shutdown_timeout_s
            with trio.CancelScope(shield=True), trio.move_on_after(bound):
                await self._release_all()
            self._log_metrics(final=True)
        return self.stats

    def stop(self) -> None:
        self._done.set()

    def _end(self, msg: wire.End) -> None:
        """The learner has trained its last version: nothing more will be trained, so stop."""
        if self.ended is None:
            self.ended = msg
            self.version = max(self.version, msg.version)
            log.info(
                "the learner ended the run at version %d (%s); stopping", msg.version, msg.message
            )
        self.stop()

    def _ended_by(self, e: BufferRefused) -> bool:
        """A ``run_ended`` reply: the end announcement this worker did not hear."""
        if e.code != "run_ended":
            return False
        self._end(wire.End(version=self.version, message=e.message))
        return True

    # -- capacity ----------------------------------------------------------------------------------

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _spent(self, n: int = 1) -> None:
        """``n`` starts were given back or taken back: capacity for new groups."""
        self.leases.spend(n)
        self._wake()

    def _settled(self, group: wire.Group) -> None:
        """The buffer acknowledged or rejected ``group``: its start is spent."""
        self.leases.settled(group.id)
        self._wake()
        if self.cfg.max_groups and self.stats.counters["groups_delivered"] >= self.cfg.max_groups:
            self._done.set()

    # -- tasks -----------------------------------------------------------------------------------

    async def _retry_sleep(self, attempt: int) -> None:
        await trio.sleep(backoff.delay_s(attempt, first=self.cfg.retry_s, cap=5.0))

    async def _register_loop(self) -> None:
        """Register the generators. The first registration of this process is ``fresh``: leases
        still open under this worker id are a dead process's, and the buffer takes them back (so
        admission waits for it: none of this process's own leases may exist yet)."""
        if not self.generators:
            self.registered.set()
            return
        self._registering = True
        fresh = not self.registered.is_set()
        attempt = 0
        while True:
            try:
                ok = await self.buffer.register(self.generators, fresh=fresh)
                self._see_version(ok.version)
                self.registered.set()
                self._registering = False
                self.stats.counters["registrations"] += 1
                self._quiet.ok("register")
                log.info("registered %d generator(s) with the learner", len(self.generators))
                return
            except (TransportTimeout, BufferRefused) as e:
                if isinstance(e, BufferRefused) and self._ended_by(e):
                    return
                if isinstance(e, BufferRefused) and e.code == "generator_unreachable":
                    raise GeneratorUnreachable(e.message) from None
                self._quiet.warning("register", "register: %s; retrying", e)
            await self._retry_sleep(attempt)
            attempt += 1

    def _see_version(self, version: int) -> None:
        if version <= self.version:
            return
        self._set_version(version)
        self._cancel_stale()
        self._wake()

    def _set_version(self, version: int) -> None:
        """The learner's version; requests need generators no more than η versions behind it."""
        self.version = version
        self.pool.min_version = max(0, version - self.cfg.max_staleness)

    def _cancel_stale(self) -> None:
        """A group whose lease version is below ``version - max_staleness`` cannot be trained."""
        oldest_ok = self.version - self.cfg.max_staleness
        for run in self._runs.values():
            if run.start.version < oldest_ok and not run.cancelled:
                run.cancelled = "stale"
                run.scope.cancel()
        for p in self.leases.take_stale(
            oldest_ok
        ):  # never started: give it back, it is worthless now
            self._nursery.start_soon(self._release, p.lease_id, 1, name="release")

    async def _version_loop(self) -> None:
        """Versions from Pub/Sub. The service repeats the current version every second or so, so
        a version that goes back, or announcements that resume after a silence, mean the learner
        restarted (from a checkpoint): the worker registers its generators again."""
        assert self.subscriber is not None
        last_heard = trio.current_time()  # a learner that dies before we first hear it counts too
        while True:
            msg = await self.subscriber.receive(timeout_s=1.0)
            if isinstance(msg, wire.End):
                self._end(msg)
                return
            if not isinstance(msg, wire.Version):
                continue
            now = trio.current_time()
            silent = now - last_heard > self.cfg.learner_silence_s  # at worst one extra Register
            last_heard = now
            if msg.version < self.version or silent:
                log.warning(
                    "the learner restarted (version %d, was %d); registering again",
                    msg.version,
                    self.version,
                )
                self._set_version(msg.version)
                if not self._registering:
                    self._nursery.start_soon(self._register_loop, name="register")
            self._see_version(msg.version)

    async def _release(self, lease_id: str, n: int) -> None:
        """Give ``n`` starts back; retried, since the buffer otherwise waits for the lease to end."""
        for attempt in range(5):
            try:
                ok = await self.buffer.release(lease_id, n)
                self.stats.counters["releases"] += n
                self._see_version(ok.version)
                break
            except BufferRefused as e:  # e.g. the lease already expired: nothing to give back
                log.info("release %s: %s", lease_id, e)
                break
            except TransportTimeout:
                await self._retry_sleep(attempt)
        self._spent(n)

    async def _release_all(self) -> None:
        """On the way out: give back every start not delivered (unused, running, unacknowledged)."""
        for lease_id, n in self.leases.surrender().items():
            try:
                await self.buffer.release(lease_id, n)
                self.stats.counters["releases"] += n
            except (TransportTimeout, BufferRefused):
                pass

    async def _admission_loop(self) -> None:
        await self.registered.wait()  # see _register_loop
        attempt = 0
        request_id = uuid.uuid4().hex  # kept until answered: a resend is not a second request
        while True:
            if self.leases.expire(trio.current_time()):  # the buffer took these starts back
                self._wake()
            cap = self.cfg.max_concurrent_groups
            while self.leases.can_start(cap) and not self._done.is_set():
                self._start_group()
            want = self.leases.wanted(cap)
            if want <= 0 or self._done.is_set():
                with trio.move_on_after(1.0):
                    await self._changed.wait()
                continue
            if not self.pool.any_eligible():
                await self._wait_for_weights()
                continue
            try:
                self.stats.counters["acquires"] += 1
                grant = await self.buffer.acquire(want, request_id=request_id)
                attempt = 0
                request_id = uuid.uuid4().hex
                self._quiet.ok("acquire")
            except (TransportTimeout, BufferRefused) as e:
                if isinstance(e, BufferRefused) and self._ended_by(e):
                    continue
                self._quiet.warning("acquire", "acquire: %s; retrying", e)
                await self._retry_sleep(attempt)
                attempt += 1
                continue
            self._see_version(grant.version)
            if grant.starts == 0:
                self.stats.counters["grants_zero"] += 1
                with trio.move_on_after(self.cfg.acquire_idle_s):
                    await self._changed.wait()
                continue
            if grant.starts > want:
                raise WorkerError(f"the buffer granted {grant.starts} starts for {want} asked")
            # the buffer's clock started the lease before our reply arrived: keep a margin
            expires = trio.current_time() + 0.95 * grant.lease_seconds
            self.leases.grant(grant.lease_id, grant.version, grant.starts, expires)

    async def _wait_for_weights(self) -> None:
        """No generator holds weights within the bound: take no lease until one does (the
        broadcaster updates them; ``/model_info`` is polled). Returns after a poll either way."""
        t0 = trio.current_time()
        self.pool.log_behind()
        await self.pool.refresh_versions()
        if not self.pool.any_eligible():
            await self._check_dropped()
            with trio.move_on_after(self.pool.version_poll_s):
                await self._changed.wait()
        else:
            self._dropped_since = None
        self.pool.log_caught_up()
        self.stats.weights_wait_s += trio.current_time() - t0

    async def _check_dropped(self) -> None:
        """Stop (:class:`WorkerError`, with the learner's reasons) once the learner has said for
        ``dropped_limit_s`` that it sends none of this worker's generators weights: they can then
        never come within the bound. Any other answer, or none, starts the count again."""
        try:
            status = await self.buffer.status()
        except (TransportTimeout, BufferRefused):
            self._dropped_since = None
            return
        said = status.stats.get("generators_dropped") or {}
        ours = {g.url.rstrip("/") for g in self.generators}
        why = {u: said[u] for u in sorted(ours) if u in said}
        now = trio.current_time()
        if not ours or len(why) < len(ours):
            self._dropped_since = None
            return
        if self._dropped_since is None:
            self._dropped_since = now
            log.warning("the learner sends this worker's generators no weights: %s", why)
        waited = now - self._dropped_since
        if waited >= self.cfg.dropped_limit_s:
            raise WorkerError(
                f"no generator within the staleness bound (learner at version {self.version}, "
                f"max_staleness {self.cfg.max_staleness}): the learner has sent them no weights "
                f"for {waited:.0f} s: " + "; ".join(f"{u}: {r}" for u, r in why.items())
            )

    def _start_group(self) -> None:
        """A group task on the oldest unused start."""
        self._seq += 1
        gid = f"{self.cfg.worker_id}-{self._nonce}-{self._seq}"
        start = self.leases.start(gid)
        run = _GroupRun(gid=gid, start=start, scope=trio.CancelScope())
        run.started_at = trio.current_time()
        deadline = start.expires_at
        run.scope.deadline = deadline  # a lease that ends takes the start back: stop generating
        self._runs[gid] = run
        self.stats.counters["groups_started"] += 1
        self._nursery.start_soon(self._group_task, run, name=f"group-{gid}")

    async def _group_task(self, run: _GroupRun) -> None:
        group: wire.Group | None = None
        failed = ""
        no_rewards = False  # played, but too few of its rewards computed: dropped, not retried
        with run.scope:
            try:
                prompt = await self.groups.take_prompt()
                run.prompt_index = prompt.item.index
                group = await self.groups.make(run.gid, run.start.lease_id, prompt)
            except RewardsFailed as e:
                failed, no_rewards = str(e), True
            except Exception as e:  # one bad group must not stop the worker
                failed = f"{type(e).__name__}: {e}"
        if run.scope.cancelled_caught and not run.cancelled:
            run.cancelled = "lease"
        del self._runs[run.gid]
        if group is not None and not run.cancelled:
            self._consecutive_failures = 0
            self.leases.finished(run.gid)
            self.sender.submit(group)
            return
        self.leases.dropped(run.gid)
        c = self.stats.counters
        if no_rewards and not run.cancelled:
            # A reward that fails on this row would fail again: its prompt counts as used.
            self.source.done(run.prompt_index)
        elif run.prompt_index >= 0:
            self.source.give_back(run.prompt_index)  # not trained on: its prompt is served again
        if run.cancelled:
            c[f"groups_cancelled_{run.cancelled}"] += 1
            log.info("group %s cancelled (%s)", run.gid, run.cancelled)
        else:
            self._consecutive_failures += 1  # a reward that always fails stops the worker too
            if no_rewards:
                c["groups_dropped_reward_failures"] += 1
                log.warning("group %s dropped: %s", run.gid, failed)
            else:
                c["groups_failed"] += 1
                log.warning("group %s failed: %s", run.gid, failed)
            if self._consecutive_failures >= self.cfg.max_consecutive_failures:
                raise WorkerError(
                    f"{self._consecutive_failures} groups failed in a row; last: {failed}"
                )
        with trio.CancelScope(shield=True):
            if run.cancelled == "lease":
                self._spent()  # the buffer already took the start back
            else:
                await self._release(run.start.lease_id, 1)

    # -- metrics ---------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, float]:
        """The metrics line: rates over the window since the last call, counters since start."""
        now = trio.current_time()
        dt = max(now - self._t_last, 1e-9)
        c = self.stats.counters
        prev = self._prev
        out: dict[str, float] = {
            names.GENERATED_TOKENS_PER_S: (c["tokens_generated"] - prev["tokens_generated"]) / dt,
            "rollout/episodes_in_flight": self.groups.episodes_in_flight,
            "rollout/groups_in_flight": self.groups_in_flight,
            "rollout/version": self.version,
            "rollout/weights_wait_s": self.stats.weights_wait_s,
        }
        if self.stats.rewards:
            out[names.REWARD_MEAN] = float(np.mean(self.stats.rewards))
            out[names.RESPONSE_LENGTH_MEAN] = float(np.mean(self.stats.lengths))
            out["rollout/response_length_max"] = float(np.max(self.stats.lengths))
        episodes = c["episodes"] - prev["episodes"]
        if self.groups.with_tools and episodes > 0:
            calling = c["tool_call_episodes"] - prev["tool_call_episodes"]
            out[names.ROLLOUT_TOOL_CALL_RATE] = calling / episodes
        if self.stats.greedy_rewards:
            out[names.GREEDY_REWARD_MEAN] = float(np.mean(self.stats.greedy_rewards))
        out.update({f"rollout/{k}": float(v) for k, v in c.items()})
        out["rollout/failures"] = float(
            c["reward_failures"] + c["groups_failed"] + c["prompts_skipped"]
        )
        out.update({f"rollout/{k}": v for k, v in self.pool.stats().items()})
        self._prev = dict(c)
        self._t_last = now
        self.stats.rewards.clear()
        self.stats.lengths.clear()
        self.stats.greedy_rewards.clear()
        return out

    def _log_metrics(self, *, final: bool = False) -> None:
        rewards, lengths = list(self.stats.rewards), list(self.stats.lengths)
        snap = self.snapshot()
        if self.metrics is not None:
            try:
                self.metrics.log(snap, step=self.version)
                if rewards:
                    self.metrics.log_histogram("rollout/reward_hist", rewards, step=self.version)
                    self.metrics.log_histogram(
                        "rollout/response_length_hist", lengths, step=self.version
                    )
            except Exception as e:  # metrics must never stop rollouts
                log.warning("metrics: %s", e)
        if final:
            log.info("worker done: %s", {k: v for k, v in snap.items() if k.count("/") == 1})

    async def _generator_versions_loop(self) -> None:
        while True:
            await trio.sleep(1.0)
            await self.pool.refresh_versions()

    async def _metrics_loop(self) -> None:
        while True:
            await trio.sleep(self.cfg.metrics_every_s)
            self._log_metrics()
