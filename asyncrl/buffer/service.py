"""The buffer's nng service, run by learner rank 0 (docs/design.md §3).

The learner's training loop is synchronous torch code, so the service is a task of rank 0's control
plane (asyncrl.control: one trio loop in a background thread) with a Req/Rep server for workers and a
Pub/Sub publisher for versions, and offers the learner a thread-safe API. Both sides share one
:class:`~asyncrl.buffer.store.ReplayStore` under one lock; every store call is short (no I/O but the
journal's, no decoding), so neither side waits long on the other. The learner waits for a batch in
the service's loop, woken when groups arrive.

Workers: Acquire -> Grant, Put -> Ack (with per-group rejection reasons), Release -> Ok,
Register -> Ok (after the ``on_register`` callbacks ran), Status -> StatusReply; anything else, and
anything undecodable, gets a ``wire.Error`` and is counted; the service keeps serving.

With ``reach`` (the learner's: :func:`asyncrl.reach.unreachable`), a worker's first (``fresh``)
Register is refused with ``Error("generator_unreachable")`` when the learner cannot connect to one
of its generators: the broadcaster could never send it weights, and the worker stops at once with
the cause. A later Register (after a learner restart) is taken whatever the network does then: a
generator cut off for a while is the broadcaster's to drop and take back (docs/design.md §4).

After :meth:`BufferService.end_run` (the learner trained its last version) the service announces
``wire.End`` instead of the version, and answers Acquire and Register with ``Error("run_ended")``,
so a worker that missed the announcement learns it at its next request.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import trio

from asyncrl import wire
from asyncrl.buffer.store import Batch, ReplayStore
from asyncrl.control import ControlPlane
from asyncrl.recipe import BufferConfig
from asyncrl.transport import TLS, Publisher, RepServer

log = logging.getLogger(__name__)

__all__ = ["Batch", "BufferService"]

RegisterCallback = Callable[[str, list[wire.GeneratorInfo]], None]
Reach = Callable[[str], Awaitable[str | None]]
"""``await reach(url)``: why the learner cannot connect to a generator, None if it can."""
T = TypeVar("T")


class BufferService:
    """The replay buffer as a service: ``start()``, then ``next_batch`` / ``set_version`` per step.

    It is an RL run's :class:`~asyncrl.learner.source.BatchSource`, by its methods: the buffer sits
    below the learner and does not import it.

    ``state`` (from :meth:`state_dict`, saved with a checkpoint) resumes the buffer where it was:
    counters, leases, stored groups, ids already seen.

    ``journal_dir`` makes an acknowledgement durable across a learner killed between checkpoints:
    every acknowledged group is appended to a journal segment before the Ack is sent, each
    :meth:`state_dict` starts a new segment (and names it in the state), and a restore stores again
    the groups of the segments written since (:meth:`ReplayStore.readmit`). The same folder holds
    ``trained.jsonl``, the audit: one line per training step (the version it made, the groups it
    consumed and their oldest token versions) and one per start (the version resumed from), and
    ``registered.json``, the workers' latest generator lists: a restore knows the generators
    registered after the checkpoint too (before their workers notice the restart, if they do).
    Appends survive the process being killed (the page cache is the kernel's), not a power cut.
    ``journal_resume=False`` (a new run, not a resumed one) deletes old segments instead.
    """

    def __init__(
        self,
        cfg: BufferConfig,
        *,
        state: dict[str, Any] | None = None,
        tls: TLS | None = None,
        announce_every_s: float = 1.0,
        register_timeout_s: float = 30.0,
        max_message_bytes: int = wire.MAX_MESSAGE_BYTES,
        clock: Callable[[], float] = time.monotonic,
        journal_dir: str | os.PathLike | None = None,
        journal_keep: int = 8,
        journal_resume: bool = True,
        reach: Reach | None = None,
    ) -> None:
        self.cfg = cfg
        self._tls = tls if tls is not None else TLS.from_config(cfg)
        self._announce_every_s = announce_every_s
        self._register_timeout_s = register_timeout_s
        self._max_message_bytes = max_message_bytes
        self._clock = clock
        self._lock = threading.Lock()  # the store: the service's requests vs the learner's calls
        self._arrived: trio.Event | None = None  # set when groups arrive (next_batch waits on it)
        self._serving = False  # the service task runs (next_batch waits in its loop)
        self._store = ReplayStore(cfg, nonce=secrets.token_hex(4))
        self._journal = Path(journal_dir) if journal_dir is not None else None
        self._journal_keep = max(journal_keep, 2)
        self._segment = 0
        self._journal_fd = -1
        self._handed: tuple[int, list[dict[str, Any]]] | None = None  # last batch, not yet trained
        self._registered: dict[str, list[wire.GeneratorInfo]] = {}  # worker id -> its generators
        if state is not None:
            self._registered = _registrations(state.get("registered", {}))
            self._store.load_state_dict(state, now=clock())
        if self._journal is not None:
            if not journal_resume:  # a new run: what an earlier one acknowledged is not ours
                for old in [*self._journal.glob("acked-*.bin"), self._registered_path]:
                    old.unlink(missing_ok=True)
            self._load_registered()
            self._open_journal(state)
        self._checkpoint = ""
        self._callbacks: list[RegisterCallback] = []
        self._rep: RepServer | None = None
        self._pub: Publisher | None = None
        self._plane: ControlPlane | None = None
        self._own_plane = False
        self._cancel: trio.CancelScope | None = None  # the service task's
        self._done: trio.Event | None = None  # set when the service task has ended
        self._failure: BaseException | None = None
        self._idle_s = 0.0
        self._end: wire.End | None = None
        self._live: set[str] = set()  # workers that registered with this process
        self._reach = reach
        self._refused: dict[str, str] = {}  # worker id -> why its last Register was refused
        self._dropped: Callable[[], dict[str, str]] = dict  # url -> why it gets no weights
        self.address = ""
        self.pub_address = ""

    # ---------------------------------------------------------------------------------------------
    # Lifecycle
    # ---------------------------------------------------------------------------------------------

    def on_register(self, callback: RegisterCallback) -> None:
        """Call ``callback(worker_id, generators)`` on every Register (e.g. the weight broadcaster).

        Callbacks run in a worker thread; one that raises makes the Register reply an Error.
        Registrations restored from a checkpoint's state are replayed to it at once: after a learner
        restart, the generators that were registered are known before their workers notice it."""
        self._callbacks.append(callback)
        for worker_id, gens in list(self._registered.items()):
            try:
                callback(worker_id, gens)
            except Exception as e:
                log.warning("restored registration of %s: %s", worker_id, e)

    def watch_generators(self, dropped: Callable[[], dict[str, str]]) -> None:
        """``dropped()``: the registered generators the learner sends no weights to, url -> why
        (the broadcaster's). They are in :meth:`stats` (workers ask for them with Status) and in
        what :meth:`waiting_cause` says; it must be quick (it runs under the store's lock)."""
        self._dropped = dropped

    def start(self, plane: ControlPlane | None = None) -> BufferService:
        """Bind both addresses and start serving as a task of ``plane`` (rank 0's control plane;
        without one the service runs its own); returns once listening."""
        if self._plane is not None:
            raise RuntimeError("buffer service already started")
        self._rep = RepServer(
            self.cfg.address, tls=self._tls, max_message_bytes=self._max_message_bytes
        )
        self._pub = Publisher(self.cfg.pub_address, tls=self._tls)
        try:
            self.address = self._rep.listen()
            self.pub_address = self._pub.listen()
        except Exception as e:
            self._rep.close()
            self._pub.close()
            raise RuntimeError(
                f"buffer service: cannot listen on {self.cfg.address} / {self.cfg.pub_address}: {e}"
            ) from None
        if plane is None:
            plane, self._own_plane = ControlPlane("buffer-service"), True
        self._plane = plane
        plane.start(self.serve, name="buffer-service")
        log.info("buffer service on %s, versions on %s", self.address, self.pub_address)
        return self

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The service task: the Req/Rep server for workers and the version announcer, until
        :meth:`stop`. Its failure is kept for :meth:`next_batch` to raise on the training thread."""
        assert self._rep is not None
        self._done = trio.Event()
        self._serving = True
        try:
            async with trio.open_nursery() as nursery:
                self._cancel = nursery.cancel_scope
                nursery.start_soon(self._rep.serve, self._handle, name="buffer-rep")
                nursery.start_soon(self._announce, name="buffer-announce")
                task_status.started()
        except Exception as e:
            self._failure = e
            log.exception("buffer service stopped")
            raise
        finally:
            self._serving = False
            self._done.set()

    async def _stop(self, timeout_s: float) -> None:
        assert self._cancel is not None and self._done is not None
        self._cancel.cancel()
        with trio.move_on_after(timeout_s):
            await self._done.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving and close the sockets (idempotent)."""
        if self._plane is not None and self._plane.alive and self._cancel is not None:
            self._plane.run(self._stop, timeout_s)
        if self._own_plane and self._plane is not None:
            self._plane.close(timeout_s)
        for sock in (self._rep, self._pub):
            if sock is not None:
                sock.close()
        with self._lock:
            if self._journal_fd >= 0:
                self._audit({"stop": self._store.version, "stored": self._store.stored_ids()})
                os.close(self._journal_fd)
                self._journal_fd = -1

    def __enter__(self) -> BufferService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------------------------------------
    # Journal of acknowledged groups, and the audit of trained ones
    # ---------------------------------------------------------------------------------------------

    def _segment_path(self, n: int) -> Path:
        assert self._journal is not None
        return self._journal / f"acked-{n:08d}.bin"

    def _segments(self) -> list[int]:
        assert self._journal is not None
        return sorted(int(p.stem.split("-")[1]) for p in self._journal.glob("acked-*.bin"))

    def _open_journal(self, state: dict[str, Any] | None) -> None:
        """Store again what was acknowledged since ``state`` was saved; open a fresh segment."""
        assert self._journal is not None
        self._journal.mkdir(parents=True, exist_ok=True)
        existing = self._segments()
        outcomes = self._replay(state)
        self._segment = max(existing, default=0) + 1
        self._journal_fd = os.open(
            self._segment_path(self._segment), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644
        )
        self._audit({"start": self._store.version, "readmitted": outcomes})

    def _replay(self, state: dict[str, Any] | None) -> dict[str, Any]:
        """Readmit the groups of the segments written since ``state`` (all, without a state)."""
        existing = self._segments()
        if state is None:
            since = 0
        else:  # a state saved without a journal: nothing after it is known
            since = int(state.get("journal_segment", max(existing, default=0) + 1))
        outcomes: dict[str, Any] = {}
        for n in existing:
            if n >= since:
                for g in self._read_segment(n):
                    r = self._store.readmit(g)
                    outcomes[r] = outcomes.get(r, 0) + 1
                    if r not in ("stored", "known"):  # acknowledged, then dropped: named
                        outcomes.setdefault("dropped_ids", {})[g.id] = r
        if outcomes:
            log.info("journal: %s acknowledged groups since the checkpoint", outcomes)
        return outcomes

    def _read_segment(self, n: int) -> list[wire.Group]:
        """The groups of one segment; a torn last record (killed mid-append) ends it."""
        data = self._segment_path(n).read_bytes()
        out, pos = [], 0
        while pos + 4 <= len(data):
            (size,) = struct.unpack_from("<I", data, pos)
            if pos + 4 + size > len(data):
                break
            try:
                out.append(wire.decode(data[pos + 4 : pos + 4 + size], expect=wire.Group))
            except wire.WireError as e:
                log.warning("journal %s: unreadable record at %d: %s", n, pos, e)
                break
            pos += 4 + size
        return out

    def _journal_groups(self, groups: list[wire.Group]) -> None:
        """Append acknowledged groups (caller holds the lock; before the Ack leaves)."""
        if self._journal_fd < 0 or not groups:
            return
        records = []
        for g in groups:
            b = wire.encode(g)
            records += [struct.pack("<I", len(b)), b]
        os.write(self._journal_fd, b"".join(records))

    def _rotate_journal(self) -> int:
        """A new segment for the groups acknowledged after a state snapshot (caller holds lock)."""
        assert self._journal is not None
        os.close(self._journal_fd)
        self._segment += 1
        self._journal_fd = os.open(
            self._segment_path(self._segment), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644
        )
        for n in self._segments():
            if n < self._segment - self._journal_keep:
                self._segment_path(n).unlink(missing_ok=True)
        return self._segment

    @property
    def _registered_path(self) -> Path:
        assert self._journal is not None
        return self._journal / "registered.json"

    def _registrations_json(self) -> dict[str, list[dict[str, Any]]]:
        return {w: [dataclasses.asdict(g) for g in gens] for w, gens in self._registered.items()}

    def _save_registered(self) -> None:
        """Replace registered.json whole (caller holds the lock): a kill leaves the old or the new."""
        if self._journal is None:
            return
        tmp = self._registered_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._registrations_json()))
        os.replace(tmp, self._registered_path)

    def _load_registered(self) -> None:
        """registered.json is never older than the checkpoint's state: it wins."""
        try:
            saved = json.loads(self._registered_path.read_text())
            self._registered = _registrations(saved)
        except FileNotFoundError:
            return
        except (OSError, ValueError, TypeError, AttributeError) as e:
            log.warning("%s: unreadable (%s); using the checkpoint's", self._registered_path, e)

    def _audit_drops(self) -> None:
        """Name the acknowledged groups the store dropped (stale, equal rewards) since last time."""
        drops, self._store.dropped_ids = self._store.dropped_ids, []
        if drops:
            self._audit({"dropped": dict(drops), "at": self._store.version})

    def _audit(self, record: dict[str, Any]) -> None:
        if self._journal is None:
            return
        record["t"] = time.time()
        with open(self._journal / "trained.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    # ---------------------------------------------------------------------------------------------
    # Worker requests (the service task)
    # ---------------------------------------------------------------------------------------------

    async def _handle(self, msg: wire.Message) -> wire.Message:
        now = self._clock()
        if self._end is not None and isinstance(msg, wire.Acquire | wire.Register):
            return wire.Error(code="run_ended", message=self._end.message)
        if isinstance(msg, wire.Put):
            with self._lock:
                ack = self._store.put(msg.groups, now=now)
                self._audit_drops()
                if ack.group_ids:
                    acked = set(ack.group_ids)
                    self._journal_groups([g for g in msg.groups if g.id in acked])
                    self._wake()
            return ack
        if isinstance(msg, wire.Acquire):
            with self._lock:
                return self._store.acquire(
                    msg.worker_id, msg.starts, now=now, request_id=msg.request_id
                )
        if isinstance(msg, wire.Release):
            with self._lock:
                reply = self._store.release(msg.lease_id, msg.starts, now=now)
                if isinstance(reply, wire.Error):
                    self._store.note_bad_message(reply.code)
            return reply
        if isinstance(msg, wire.Status):
            with self._lock:
                return wire.StatusReply(version=self._store.version, stats=self._stats())
        if isinstance(msg, wire.Register):
            return await self._register(msg)
        with self._lock:
            self._store.note_bad_message("unexpected_kind")
        return wire.Error(
            code="unexpected_kind",
            message=f"the buffer does not take {msg.kind!r} requests "
            "(it takes acquire, put, release, register, status)",
        )

    async def _register(self, msg: wire.Register) -> wire.Message:
        if msg.fresh and self._reach is not None:
            why = await self._unreachable(msg.generators)
            if why:
                log.warning("register from %s refused: %s", msg.worker_id, why)
                with self._lock:
                    self._refused[msg.worker_id] = why
                return wire.Error(code="generator_unreachable", message=why)
        for cb in self._callbacks:
            try:
                with trio.fail_after(self._register_timeout_s):
                    await trio.to_thread.run_sync(
                        cb, msg.worker_id, msg.generators, abandon_on_cancel=True
                    )
            except Exception as e:
                log.warning("register from %s failed: %s", msg.worker_id, e)
                return wire.Error(code="register_failed", message=f"{type(e).__name__}: {e}")
        with self._lock:
            self._registered[msg.worker_id] = list(msg.generators)
            self._live.add(msg.worker_id)
            self._refused.pop(msg.worker_id, None)
            self._save_registered()
            returned = self._store.abandon(msg.worker_id) if msg.fresh else 0
            version = self._store.version
        if returned:
            self._wake()
            log.info("%s restarted: its old leases gave back %d starts", msg.worker_id, returned)
        return wire.Ok(version=version, message=f"{len(msg.generators)} generator(s)")

    async def _unreachable(self, generators: list[wire.GeneratorInfo]) -> str:
        """Why the learner cannot reach these generators ("" if it reaches them all): each asked
        at once."""
        assert self._reach is not None
        reach = self._reach
        causes: dict[str, str] = {}

        async def ask(g: wire.GeneratorInfo) -> None:
            cause = await reach(g.url)
            if cause is not None:
                causes[g.url] = _unreachable_text(g, cause)

        with trio.move_on_after(self._register_timeout_s) as scope:
            async with trio.open_nursery() as nursery:
                for g in generators:
                    nursery.start_soon(ask, g)
        if scope.cancelled_caught:  # a probe outlived its own bound: say so, never hang
            for g in generators:
                causes.setdefault(g.url, _unreachable_text(g, "no answer in time"))
        return "; ".join(causes[g.url] for g in generators if g.url in causes)

    def _wake(self) -> None:
        """Groups or starts came back: a waiting next_batch looks again (the service's loop)."""
        if self._arrived is not None:
            self._arrived.set()

    async def _announce(self) -> None:
        """Repeat the current version (or the end): a subscriber only hears what is sent after it
        connects."""
        assert self._pub is not None
        while True:
            try:
                with self._lock:
                    msg = self._end or self._version_message()
                await self._pub.publish(msg)
            except Exception as e:  # a slow network must not stop the service
                log.warning("version announcement failed: %s", e)
            await trio.sleep(self._announce_every_s)

    def _version_message(self) -> wire.Version:
        return wire.Version(
            version=self._store.version,
            checkpoint=self._checkpoint,
            max_staleness=self.cfg.max_staleness,
        )

    # ---------------------------------------------------------------------------------------------
    # The learner's API (any thread)
    # ---------------------------------------------------------------------------------------------

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        with self._lock:
            return fn(*args)

    @property
    def version(self) -> int:
        return self._call(lambda: self._store.version)

    def next_batch(self, timeout_s: float | None = None) -> Batch:
        """The next batch of whole groups, oldest first; waits up to ``timeout_s`` (default: the
        recipe's ``batch_timeout_s``). With ``min_batch_fill < 1``, after ``partial_batch_after_s``
        a batch of at least that fraction is taken. Raises TimeoutError saying what is missing."""
        timeout = self.cfg.batch_timeout_s if timeout_s is None else timeout_s
        if self._failure is not None:
            raise RuntimeError(f"buffer service stopped: {self._failure}")
        if not self._serving or self._plane is None:  # nobody can put: what is stored, or nothing
            now = self._clock()
            batch = self._call(self._take, now, now, None)
            if batch is None:
                raise self._call(self._timeout, timeout)
            return batch
        return self._plane.run(self._next_batch, timeout)

    async def _next_batch(self, timeout: float) -> Batch:
        start = self._clock()
        partial_at = start + self.cfg.partial_batch_after_s if self.cfg.min_batch_fill < 1 else None
        while True:
            self._arrived = trio.Event()
            now = self._clock()
            with self._lock:
                batch = self._take(now, start, partial_at)
                if batch is None and now - start >= timeout:
                    raise self._timeout(timeout)
            if batch is not None:
                return batch
            wake = start + timeout - now
            if partial_at is not None and now < partial_at:
                wake = min(wake, partial_at - now)
            # Also wake now and then: leases expire by the clock, not by a message.
            with trio.move_on_after(max(0.0, min(wake, 0.5))):
                await self._arrived.wait()

    def _take(self, now: float, start: float, partial_at: float | None) -> Batch | None:
        allow_partial = partial_at is not None and now >= partial_at
        batch = self._store.take_batch(now, allow_partial=allow_partial)
        self._audit_drops()
        if batch is not None:
            self._handed = (
                batch.version,
                [{"id": g.id, "min_version": g.behavior_version} for g in batch.groups],
            )
            waited = self._clock() - start
            self._idle_s += waited
            batch.stats["wait_s"] = waited
        return batch

    def _timeout(self, timeout: float) -> TimeoutError:
        return TimeoutError(
            f"buffer: no batch of {self.cfg.groups_per_batch} groups within {timeout:g} s "
            + self._waiting_cause()
        )

    def waiting_cause(self) -> str:
        """What the learner's wait for a batch is waiting on, as far as the service knows: what
        is stored and being generated, and the cause when it knows one (no worker registered,
        registrations refused, generators the learner sends no weights to)."""
        return self._call(self._waiting_cause)

    def _waiting_cause(self) -> str:
        s = self._store.stats()
        text = (
            f"at version {s['version']} ({s['occupancy']}/{self.cfg.groups_per_batch} groups "
            f"stored, {s['grants_in_flight']} starts in flight, {s['capacity']} free)"
        )
        drops = ", ".join(f"{n} {why}" for why, n in s.get("dropped", {}).items() if n)
        if drops:
            text += f"; groups dropped so far: {drops}"
        refused = "; ".join(f"{w}: {why}" for w, why in self._refused.items())
        if refused:
            text += f"; registrations refused: {refused}"
        if not self._live and not self._registered:
            text += f"; no worker registered with {self.address}"
        dropped = self._dropped()
        if dropped:
            text += "; no weights to " + "; ".join(f"{u} ({why})" for u, why in dropped.items())
        return text

    def set_version(self, v: int, checkpoint: str = "") -> None:
        """The learner's policy version after an optimizer step (and, if given, an HF export of
        it); announced to workers at once and repeated every ``announce_every_s``."""
        message = self._call(self._set_version, v, checkpoint)
        if message is not None and self._pub is not None and self._plane is not None:
            try:
                self._pub.publish_sync(message)
            except Exception as e:
                log.warning("version announcement failed: %s", e)

    def _set_version(self, v: int, checkpoint: str) -> wire.Version | None:
        """The announcement to send at once, if any."""
        if self._handed is not None and v > self._handed[0]:
            self._audit({"version": v, "trained_at": self._handed[0], "groups": self._handed[1]})
            self._handed = None
        changed = self._store.set_version(v)
        self._audit_drops()
        if checkpoint:
            self._checkpoint = checkpoint
        return self._version_message() if changed or checkpoint else None

    def adapt_depth(self, metrics: dict[str, float]) -> None:
        """After a step: its importance weights' ESS (``loss/ess``) and KL(μ ‖ π_prox)
        (``loss/kl_mu_k3``) set the pipeline depth admission allows
        (:meth:`ReplayStore.adapt_depth`; nothing without ``buffer.adaptive_depth_*``)."""
        self._call(self._store.adapt_depth, metrics.get("loss/ess"), metrics.get("loss/kl_mu_k3"))

    def end_run(self, message: str = "") -> None:
        """The learner has trained its last version: announce ``wire.End`` at once and from now on
        instead of the version, and refuse new starts and registrations (``run_ended``). Keep the
        service running a little after this, so workers can give their starts back."""
        end = self._call(self._end_run, message)
        if self._pub is not None and self._plane is not None:
            try:
                self._pub.publish_sync(end)
            except Exception as e:  # repeated by _announce anyway
                log.warning("end-of-run announcement failed: %s", e)

    def _end_run(self, message: str) -> wire.End:
        self._end = wire.End(version=self._store.version, message=message)
        return self._end

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state to save with the learner's checkpoint."""
        return self._call(self._state_dict)

    def _state_dict(self) -> dict[str, Any]:
        state = self._store.state_dict()
        state["registered"] = self._registrations_json()
        if self._journal is not None:
            state["journal_segment"] = self._rotate_journal()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._call(self._load_state_dict, state)

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        self._store.load_state_dict(state, now=self._clock(), nonce=secrets.token_hex(4))
        if self._journal is not None:
            self._audit({"start": self._store.version, "readmitted": self._replay(state)})

    def stats(self) -> dict[str, Any]:
        """The store's counters plus the service's: bad messages, learner idle seconds."""
        return self._call(self._stats)

    def _stats(self) -> dict[str, Any]:
        s = self._store.stats()
        bad = dict(s["bad_messages"])
        if self._rep is not None:
            for key, name in (("bad_messages", "undecodable"), ("handler_errors", "internal")):
                if self._rep.stats[key]:
                    bad[name] = self._rep.stats[key]
        s["bad_messages"] = bad
        s["bad_messages_total"] = sum(bad.values())
        s["learner_wait_s"] = self._idle_s
        s["workers_registered"] = len(self._live)
        s["registrations_refused"] = dict(self._refused)
        s["generators_dropped"] = self._dropped()
        s["ended"] = self._end is not None
        return s


def _unreachable_text(g: wire.GeneratorInfo, cause: str) -> str:
    """The refusal of a generator the learner cannot reach: its url, the cause, and the key."""
    if g.kind == "builtin":
        fix = (
            "a built-in engine listens on generator.host: leave it empty (this host's address on "
            "the route to the learner) or set an address of the worker's host the learner reaches"
        )
    else:
        fix = (
            "generator.urls must name the server by an address the learner reaches, and the "
            "server listen there (not on loopback)"
        )
    return f"the learner cannot reach generator {g.url} ({cause}); {fix}"


def _registrations(saved: dict[str, Any]) -> dict[str, list[wire.GeneratorInfo]]:
    """Worker id -> its generators, from the JSON of a state or of registered.json."""
    return {str(w): [wire.GeneratorInfo(**g) for g in gens] for w, gens in saved.items()}
