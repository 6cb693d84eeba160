"""The versioned weight broadcaster: learner rank 0 pushes each new policy version to every generator.

Per version (docs/design.md §4): every generator is paused in place (no abort, no drain),
a session is opened (``/begin_weight_update``; 404 on old SGLang: no session), the weights go out in
buckets (one ``/update_weights_from_distributed`` call per bucket, posted concurrently with rank 0's
broadcast of that bucket), the session is closed and generation continues. Then each generator is
asked which version it holds and for its checksum, compared with the checksum of what was sent.

One weight group per generator (learner rank 0 and that generator's ranks), all of a bucket's
broadcasts in flight at once: a peer that dies takes down its own group only. SGLang builds its
side of a group with a 30-minute timeout and aborts the server when a collective in it fails
(``InitWeightsUpdateGroupReqInput`` has no timeout), so in a shared group one death would take
every server with it. The price: rank 0 sends the bytes once per generator (docs/gpu.md).

Never hangs: every HTTP call and every broadcast has a bound (``WeightsConfig.timeout_s``). A
generator that fails or does not answer is dropped and its group abandoned; the others go on with
the same version, in the same attempt. A dropped generator that answers ``/health`` again first
loads the latest exported HF checkpoint from disk, then joins with a new group at the next version.

Refused: a server whose ``/server_info`` says it cannot take these updates (its radix cache on with
``pause_mode: in_place``: new requests would reuse KV the old weights computed; a layout SGLang
cannot join) is asked before it joins a group or loads an export, and is sent nothing: dropped, with
one error line naming it and the fix, and asked again before each version until it is relaunched.

Overlap: :meth:`WeightBroadcaster.publish` copies the snapshot on the caller's (training) thread and
hands it to the sender task, a task of rank 0's control plane (asyncrl.control), which sends it while
the learner computes the next version: a task per generator for the HTTP calls, the broadcast in a
worker thread, every wait in a cancel scope. At most one version is in flight (the next publish waits
for its transfer). ``overlap: false`` sends synchronously. A hook
(``after_sync``: the held-out evaluation) may hold the generators on a version after it is out; the
learner does not wait for it: what it publishes meanwhile goes out when the hold ends, newest only.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
import trio

from asyncrl import metric_names
from asyncrl.control import ControlPlane
from asyncrl.generator_http import GeneratorError, GroupSpec, WeightsClient
from asyncrl.gpu import cuda_uuid, needs_gloo
from asyncrl.recipe import WeightsConfig
from asyncrl.rollout.sglang_protocol import parse_version_label
from asyncrl.transport import free_port
from asyncrl.weights import buckets, rendezvous
from asyncrl.weights.exports import latest_export
from asyncrl.wire import GeneratorInfo

log = logging.getLogger("asyncrl.weights")

VERIFY_SAMPLE = 4096
"""Values per tensor the ``sampled`` verification hashes on both sides (weights.verify)."""

TIED_PAIRS = (("lm_head.weight", "model.embed_tokens.weight"),)
"""(name, source): when both are sent and equal, only the source goes out, as SGLang's own test does."""


T = TypeVar("T")

# --------------------------------------------------------------------------------------------------
# Snapshots
# --------------------------------------------------------------------------------------------------


@dataclass
class Snapshot:
    """One version's weights as they go on the wire: buckets of owned tensors (never the live ones)."""

    version: int
    buckets: list[buckets.Bucket]
    payloads: list[list[torch.Tensor]]  # per bucket: what rank 0 broadcasts, in order
    nbytes: int
    snapshot_s: float = 0.0  # time to build it (the copy into buckets)

    def named(self) -> Iterable[tuple[str, torch.Tensor]]:
        for b in self.buckets:
            yield from zip(b.names, b.tensors, strict=True)


def drop_tied(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop ``lm_head.weight`` when it is the same storage as, or equal to, the input embedding."""
    out = dict(named)
    for name, source in TIED_PAIRS:
        a, b = out.get(name), out.get(source)
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
            continue
        if a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() or torch.equal(a, b):
            del out[name]
    return out


def make_snapshot(
    version: int,
    named: Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    bucket_bytes: int,
    load_format: str,
    copy: bool = True,
) -> Snapshot:
    """``named`` as wire buckets: floating tensors cast to ``dtype``, tied copies sent once.

    ``copy``: the snapshot must not share memory with ``named`` (the learner will change it). The
    flattened layout always copies; with ``list`` and ``copy=False`` tensors are sent as they are."""
    named = drop_tied(named)

    def cast(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    itemsize = torch.empty((), dtype=dtype).element_size()

    def wire_bytes(t: torch.Tensor) -> int:
        return t.numel() * (itemsize if t.is_floating_point() else t.element_size())

    groups: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for n, t in named.items():  # as buckets.make_buckets, but sized as sent (after the cast)
        s = wire_bytes(t)
        if groups[-1] and size + s > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append((n, t))
        size += s
    out_buckets: list[buckets.Bucket] = []
    payloads: list[list[torch.Tensor]] = []
    for g in groups:
        if not g:
            continue
        names = [n for n, _ in g]
        if load_format == "flattened_bucket":
            tensors = [cast(t) for _, t in g]  # casting one bucket at a time bounds extra memory
            flat = buckets.flatten(tensors)  # the copy
            dts, shapes = [t.dtype for t in tensors], [list(t.shape) for t in tensors]
            out_buckets.append(
                buckets.Bucket(names=names, tensors=buckets.unflatten(flat, dts, shapes))
            )
            payloads.append([flat])
        else:
            tensors = [cast(t) for _, t in g]
            tensors = [
                t.clone(memory_format=torch.contiguous_format) if copy else t.contiguous()
                for t in tensors
            ]
            out_buckets.append(buckets.Bucket(names=names, tensors=tensors))
            payloads.append(tensors)
    total = sum(b.nbytes for b in out_buckets)
    return Snapshot(version=version, buckets=out_buckets, payloads=payloads, nbytes=total)


def _cuda_ready(tensors: Iterable[torch.Tensor]) -> Any:
    """A CUDA event recorded on the producer's (current) stream after every kernel queued so far,
    those that make ``tensors`` included: call it once they are queued. None for CPU tensors."""
    first = next(iter(tensors), None)
    if first is None or not first.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _background_priority() -> None:
    """Run this thread at a lower CPU priority than the training thread (Linux nice is per thread,
    and the gloo threads of a group built from here inherit it): where the learner and the transfer
    share CPU cores, the overlapped broadcast then takes less from the learner's step."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (OSError, AttributeError):  # not Linux, or not allowed: run at normal priority
        pass


_MIN_WAIT_S = 0.01
"""The shortest bounded wait on a work once the bucket's deadline has passed (a last look)."""


K = TypeVar("K")


def broadcast_bucket(
    groups: Mapping[K, dist.ProcessGroup], payload: list[torch.Tensor], timeout_s: float
) -> dict[K, str]:
    """Rank 0's broadcasts of one bucket into every group of ``groups``, bounded by ``timeout_s``:
    an error message per group that failed (none: every group received all of it).

    All groups' works are launched before any is waited on, so they run at once (a gloo group has
    its own threads, an NCCL group its own stream) and a silent peer's group costs the others
    nothing: they are checked against the same deadline, completed by then.

    A wait's end is not taken for the broadcast's: each work must report itself completed after its
    bounded ``wait``. gloo's ``wait(timeout)`` raises when the bound passes. ProcessGroupNCCL's
    ``WorkNCCL::wait`` leaves its loop with a log line when the bound passes and throws only if the
    work then holds an exception (which its ``checkTimeout`` records); a wait that returns without
    one would otherwise pass for a sent bucket while a peer never received it. Launching the broadcast on a nonblocking NCCL communicator (the first one
    also waits for its init) is bounded by ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` instead, which the
    learner sets to ``weights.timeout_s`` (:func:`asyncrl.gpu.trainer_nccl_env`)."""
    deadline = time.monotonic() + timeout_s
    errors: dict[K, str] = {}
    works: dict[K, list[Any]] = {}
    for key, pg in groups.items():
        try:
            works[key] = [dist.broadcast(t, src=0, group=pg, async_op=True) for t in payload]
        except Exception as e:
            errors[key] = f"broadcast: {e}".splitlines()[0][:300]
    for key, group_works in works.items():
        try:
            for w in group_works:
                # never 0: c10d reads a zero timeout as none at all (kNoTimeout)
                left = max(_MIN_WAIT_S, deadline - time.monotonic())
                done = w.wait(timeout=timedelta(seconds=left))
                if done is False or not w.is_completed():
                    errors[key] = (
                        f"broadcast: not complete within {timeout_s:g}s (a peer did not receive)"
                    )
                    break
        except Exception as e:  # gloo: a dead peer resets the connection or the wait times out
            errors[key] = f"broadcast: {e}".splitlines()[0][:300]
    return errors


# --------------------------------------------------------------------------------------------------
# Membership and reports
# --------------------------------------------------------------------------------------------------

State = Literal["joining", "member", "dropped", "removed"]


@dataclass
class Member:
    """The broadcaster's view of one generator."""

    info: GeneratorInfo
    client: WeightsClient
    state: State = "joining"
    version: int | None = None  # the last version it confirmed (None: its initial weights)
    sessions: bool | None = None  # has /begin_weight_update (SGLang >= 0.5.21, the built-in engine)
    reason: str = ""  # why it was dropped
    from_disk: bool = False  # a rejoining generator loads the latest export before joining
    ranks: int | None = None  # ranks it takes in the group (its tp_size), asked before a build
    refused: str = ""  # why its settings cannot take the updates (:class:`Refused`): kept out
    device: str | None = None  # its /server_info's ``device`` (None: not said), asked with ranks
    gpu_uuid: str | None = None  # its /server_info's ``gpu_uuid``: the GPU it runs on, if said

    @property
    def url(self) -> str:
        return self.client.url

    def needs_gloo(self, sender_gpu: str | None) -> bool:
        """It cannot join an NCCL group with rank 0 on ``sender_gpu``: it receives on CPU, or
        runs on that very GPU (:func:`asyncrl.gpu.needs_gloo`)."""
        return needs_gloo(self.info.kind, self.device, self.gpu_uuid, sender_gpu=sender_gpu)


@dataclass
class SyncReport:
    """What one version's broadcast did (also logged as metrics)."""

    version: int
    updated: list[str] = field(default_factory=list)  # urls that hold this version now
    dropped: list[str] = field(default_factory=list)  # urls dropped during this version
    sync_s: float = 0.0  # pause, transfer, resume: the generators' side of the update
    snapshot_s: float = 0.0  # building the buckets (on the training thread unless owned)
    nbytes: int = 0
    attempts: int = 0
    group_builds: int = 0
    pause_s: dict[str, float] = field(default_factory=dict)
    reported: dict[str, str | None] = field(default_factory=dict)  # /model_info weight_version
    checksum: str = ""
    checksum_ok: dict[str, bool | None] = field(default_factory=dict)  # None: not comparable
    error: str = ""

    @property
    def mismatches(self) -> list[str]:
        bad = [u for u, ok in self.checksum_ok.items() if ok is False]
        bad += [u for u in self.updated if self.reported.get(u) != str(self.version)]
        return sorted(set(bad))


Job = Callable[[], Awaitable[SyncReport]]
"""One version's send, run by the sender task."""
Hold = Callable[[], None]
"""Blocking work (the held-out evaluation) during which the generators hold the version they have."""

HTTP_CALLS = 32
"""Blocking HTTP calls to generators in flight at once (worker threads)."""


@dataclass
class _Group:
    """One generator's weight group: learner rank 0 and that generator's ranks."""

    pg: dist.ProcessGroup
    spec: GroupSpec


class Refused(GeneratorError):
    """A generator whose settings cannot take this broadcaster's updates (``message``: why, and the
    fix). Nothing is sent to it while they stay so."""


class _Failed(Exception):
    """Some generators failed during an attempt: ``culprits`` are dropped, the rest retry."""

    def __init__(self, culprits: dict[str, str], message: str):
        self.culprits = culprits
        super().__init__(message)


def _say_refused(url: str, problem: str) -> None:
    log.error("weights: generator %s refused, no weights sent to it: %s", url, problem)


# --------------------------------------------------------------------------------------------------
# The broadcaster
# --------------------------------------------------------------------------------------------------


class WeightBroadcaster:
    """Learner-side weight broadcaster. Construct it on every learner rank; only rank 0 sends.

    Use ``trainer.publishers.append(b.on_step)`` (all ranks: it takes the ``hf_state_dict()``
    collective every ``cfg.every`` versions), or call :meth:`publish` on rank 0 with HF-named tensors.
    """

    def __init__(
        self,
        cfg: WeightsConfig,
        *,
        export_dir: str | Path | None = None,
        rank: int | None = None,
        verify: bool = True,
        on_event: Callable[[str, dict], None] | None = None,
        api_key: str | None = None,
        after_sync: Callable[[SyncReport], None] | None = None,
        plane: ControlPlane | None = None,
    ):
        """``export_dir``: where the learner exports HF checkpoints (rejoining generators load the newest).
        ``on_event(name, fields)``: progress callback ("bucket_sent", "dropped", "synced", ...),
        called in the control plane's loop: it must be quick.
        ``after_sync(report)``: runs in a worker thread after each version, before the next one
        goes out, so the generators hold ``report.version`` while it runs (the held-out
        evaluation, asyncrl.learner.evaluator).
        ``plane``: the control plane whose nursery runs the sender task (rank 0); without one the
        broadcaster runs its own."""
        self.cfg = cfg
        self.export_dir = Path(export_dir) if export_dir is not None else None
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = rank
        self.verify = verify
        self.on_event = on_event
        self.api_key = api_key
        self.after_sync = after_sync
        self.dtype = buckets.parse_dtype(cfg.dtype)
        # Rank 0's GPU, read here in the training thread (where the learner set its device; the
        # CUDA current device is per thread), for each group's backend, chosen from its member
        # (:meth:`_backend_for`).
        self.sender_gpu = cuda_uuid() if rank == 0 else None
        self.bucket_bytes = max(1, int(cfg.bucket_mb * 2**20))
        # A live generator in a failed collective (a broadcast, a group's rendezvous) answers only
        # once its own group timed out (timeout_s) and then as any call: it must not be taken for a
        # dead one before that.
        self._survivor_s = 2 * cfg.timeout_s + 5
        self.reports: list[SyncReport] = []
        self._metrics: dict[str, Any] = {}  # of the versions synced since take_metrics()
        self.last_version = 0  # the newest version handed to publish()
        self._members: dict[str, Member] = {}
        self._by_worker: dict[str, set[str]] = {}
        self._lock = threading.Lock()  # membership (callers' threads vs the sender task)
        self._groups: dict[str, _Group] = {}  # url -> its weight group (the sender task's)
        self._builds = 0
        # Group names unique to this broadcaster: a generator may still hold the group of a learner
        # that was killed (it cannot be told to destroy it), and an init under that name fails.
        self._nonce = f"{os.getpid():x}{int(time.time()) % 65536:04x}"
        self._last_forced = -float("inf")
        # The sender task's state (rank 0; touched only in the control plane's loop). The hold
        # (after_sync, between_versions): a version published meanwhile waits as the pending one.
        self._holding = False
        self._pending: Job | None = None
        self._running = False  # a version (or a hold) is in flight
        self._idle = trio.Event()  # set when nothing is in flight; replaced per run
        self._sent = trio.Event()  # set when the version in flight is out; replaced per version
        self._idle.set()
        self._sent.set()
        self._work: trio.MemorySendChannel[tuple[Job | None, Hold | None]] | None = None
        self._background: trio.Nursery | None = None  # abandoned groups' teardown
        self._http_limiter = trio.CapacityLimiter(HTTP_CALLS)
        self._collective_limiter = trio.CapacityLimiter(1)  # one broadcast or rendezvous at a time
        self._ready: Any = None  # the version in flight's CUDA event (GPU only)
        self._stream: Any = None  # the sender's CUDA stream, made on first use (GPU only)
        self.skipped = 0  # versions replaced by a newer one while the generators were held
        self._closed = False
        self._plane = plane
        self._own_plane = False
        if self.rank == 0:
            if self._plane is None:
                self._plane, self._own_plane = ControlPlane("weights-sender"), True
            self._plane.start(self.serve, name="weights-sender")

    # ---- membership (any thread) -----------------------------------------------------------------

    def add_generator(self, info: GeneratorInfo) -> None:
        """Register a generator; it joins the group at the next version."""
        url = info.url.rstrip("/")
        with self._lock:
            m = self._members.get(url)
            if m is not None and m.state != "removed":
                m.info = info
                return
            client = WeightsClient(info, timeout_s=self.cfg.timeout_s, api_key=self.api_key)
            self._members[url] = Member(info=info, client=client, state="joining")
        log.info(
            "weights: generator %s registered (%s, %d rank(s))", url, info.kind, info.world_size
        )

    def remove_generator(self, url: str) -> None:
        """Stop sending to a generator from the next version on."""
        url = url.rstrip("/")
        with self._lock:
            m = self._members.get(url)
            if m is None or m.state == "removed":
                return
            m.state = "removed"
        log.info("weights: generator %s removed", url)

    def on_register(self, worker_id: str, generators: list[GeneratorInfo]) -> None:
        """The buffer service's callback: a worker's current generator list (replaces its last one)."""
        urls = {g.url.rstrip("/") for g in generators}
        with self._lock:
            gone = self._by_worker.get(worker_id, set()) - urls
            self._by_worker[worker_id] = urls
        for g in generators:
            self.add_generator(g)
        for url in gone:
            self.remove_generator(url)

    def generators(self) -> dict[str, str]:
        """url -> state ("joining", "member", "dropped")."""
        with self._lock:
            return {u: m.state for u, m in self._members.items() if m.state != "removed"}

    # ---- publishing (training thread) ------------------------------------------------------------

    def needs_sync(self) -> bool:
        """A registered generator waits to join and no version is in flight (rank 0). A learner
        idle for want of data then publishes its current version at once: after a learner restart,
        or with one fresh worker, that generator's tokens are too old to train on until it has the
        learner's weights, and without a step no next version would come (a deadlock)."""
        if self._running:
            return False
        with self._lock:
            states = {m.state for m in self._members.values()}
        if "joining" in states:
            return True
        # A dropped one is probed (and brought back) only when a version goes out: now and then.
        return "dropped" in states and time.monotonic() - self._last_forced > self.cfg.timeout_s

    def on_step(self, version: int, trainer: Any, *, force: bool = False) -> None:
        """Trainer publisher hook, on every rank: snapshot every ``cfg.every`` versions and send
        (``force``: this version whatever ``cfg.every``, e.g. for a generator that just joined)."""
        if version % self.cfg.every and not force:
            return
        if force:
            self._last_forced = time.monotonic()
        # A collective (every rank calls it at the same point); only rank 0 keeps the tensors, gathered
        # one at a time in the wire dtype, and they are fresh copies it may own.
        named = trainer.hf_state_dict(self.dtype, all_ranks=False)
        if self.rank == 0:
            self.publish(version, named, owned=True)

    def publish(
        self, version: int, named_tensors: Mapping[str, torch.Tensor], *, owned: bool = False
    ) -> None:
        """Send ``version``: snapshot the tensors, send them in the background (or now, no overlap).

        ``owned``: the caller hands the tensors over and never changes them (``hf_state_dict()``
        returns fresh copies), so even the bucket copy happens off the training thread. Otherwise
        they are copied before this returns, as the learner may step right after. Waits for the
        previous version's transfer first (at most one in flight). While the generators are held
        on a version (``after_sync`` runs, e.g. the held-out evaluation), it does not wait: the
        version goes out when the hold ends, and a newer one published meanwhile replaces it
        (counted in ``skipped``). A no-op on ranks other than 0.
        """
        if self.rank != 0:
            return
        if self._closed:
            raise RuntimeError("weight broadcaster is closed")
        assert self._plane is not None
        # The sender's stream waits on ``ready`` (:meth:`_on_stream`), so it is recorded after the
        # last kernel the sender reads from: the gather when owned (the sender copies the buckets
        # itself), else the bucket copies queued just above on this (training) stream. Recorded
        # before them, the broadcast could read a bucket whose copy had not run yet.
        if owned:
            named = dict(named_tensors)
            ready = _cuda_ready(named.values())
            make = functools.partial(self._snapshot, version, named, copy=False)
        else:
            snap = self._snapshot(version, named_tensors)
            ready = _cuda_ready(t for payload in snap.payloads for t in payload)
            make = lambda: snap  # noqa: E731
        self._plane.run(self._hand_over, version, functools.partial(self._version, ready, make))
        if not self.cfg.overlap:
            self.wait()

    def between_versions(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (in a worker thread) once the version in flight (if any) is out, holding the
        generators on it while ``fn`` runs, as ``after_sync`` does (rank 0; the run's first
        held-out evaluation, of the weights the generators started from). Call it from the
        thread that publishes. Its failure is logged, never raised."""
        if self.rank != 0 or self._closed:
            return
        assert self._plane is not None
        self._plane.run(self._hold, fn)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the in-flight broadcast; False if it is still running after ``timeout`` seconds."""
        if self._plane is None or not self._plane.alive:
            return True
        return self._plane.run(self._wait_idle, math.inf if timeout is None else timeout)

    def take_metrics(self) -> dict[str, Any]:
        """The metrics of the versions synced since the last call (the newest's win), with
        ``weights/version``: the learner logs them with its next step's record, one record per step."""
        if self._plane is None or not self._plane.alive:
            return {}
        return self._plane.run_sync(self._take_metrics)

    def _take_metrics(self) -> dict[str, Any]:
        out, self._metrics = self._metrics, {}
        return out

    def close(self) -> None:
        """Finish the in-flight broadcast, leave the group and close the HTTP clients."""
        if self._closed:
            return
        self._closed = True
        if self._plane is None:
            return
        self.wait()
        if self._plane.alive:
            self._plane.run(self._close)
        if self._own_plane:
            self._plane.close()

    def __enter__(self) -> WeightBroadcaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the sender task (the control plane's loop) ----------------------------------------------

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The sender task: runs each version (and hold) handed over by the training thread, one
        at a time; ends when :meth:`close` closes its channel."""
        send, recv = trio.open_memory_channel[tuple[Job | None, Hold | None]](1)
        async with trio.open_nursery() as background, recv:
            self._background, self._work = background, send
            task_status.started()
            async for job, hold in recv:
                await self._run(job, hold)
            background.cancel_scope.cancel()  # a group still being abandoned is left to its thread

    async def _hand_over(self, version: int, job: Job) -> None:
        """``publish``: once the previous version is out, hold it as pending while the generators
        are held (newest wins), else start it once the sender is idle."""
        await self._sent.wait()
        if self._holding:
            if self._pending is not None:
                self.skipped += 1
            self._pending = job
            self.last_version = version
            return
        await self._idle.wait()
        self.last_version = version
        self._start(job, None)

    async def _hold(self, fn: Hold) -> None:
        await self._idle.wait()
        self._holding = True
        self._start(None, fn)

    def _start(self, job: Job | None, hold: Hold | None) -> None:
        assert self._work is not None and self._idle.is_set()
        self._running = True
        self._idle = trio.Event()
        if job is not None:
            self._sent = trio.Event()
        self._work.send_nowait((job, hold))

    async def _wait_idle(self, timeout: float) -> bool:
        with trio.move_on_after(timeout):
            await self._idle.wait()
            return True
        return False

    async def _run(self, job: Job | None, hold: Hold | None) -> None:
        """Send a version; hold the generators on it while ``after_sync`` runs (``publish``
        meanwhile keeps the newest version as pending); send the pending one; again."""
        try:
            while True:
                if job is not None:
                    report = await job()
                    job = None
                    if self.after_sync is not None:
                        self._holding = True
                        hold = functools.partial(self.after_sync, report)
                    self._sent.set()
                if hold is not None:
                    try:
                        await trio.to_thread.run_sync(self._niced, hold)
                    except Exception:  # the hook's failure must not stop the weights
                        log.exception("weights: the hold after a version raised")
                    hold = None
                job, self._pending = self._pending, None
                self._holding = False
                if job is None:
                    return
                self._sent = trio.Event()
        finally:  # even on an error: publish() must never wait for a sender that has stopped
            self._holding = False
            self._running = False
            self._sent.set()
            self._idle.set()

    async def _version(self, ready: Any, make: Callable[[], Snapshot]) -> SyncReport:
        """One version: its snapshot (built in a worker thread when the tensors are owned), then
        its sync; on GPU the sender's stream is drained before the snapshot is released, so the
        allocator cannot hand its memory to the training stream while a broadcast still reads it."""
        self._ready = ready
        try:
            snap = await self._in_thread(make)
            return await self._sync_logged(snap)
        finally:
            if ready is not None and self._stream is not None:
                await trio.to_thread.run_sync(self._stream.synchronize)
            self._ready = None

    async def _close(self) -> None:
        with self._lock:
            members = list(self._members.values())
            live = {m.url for m in members if m.state == "member"}
        # a dropped one's group (not left yet) is abandoned: its server may not answer
        await self._drop_groups([u for u in self._groups if u not in live], tell=False)
        await self._drop_groups(list(self._groups), background=False)
        if self._work is not None:
            self._work.close()  # ends serve()
        for m in members:
            m.client.close()

    # ---- blocking calls, in worker threads -------------------------------------------------------

    def _niced(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn`` in a worker thread, at a lower priority with overlap: the transfer runs beside
        the learner's step."""
        if self.cfg.overlap:
            _background_priority()
        return fn(*args)

    def _on_stream(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn`` in a worker thread, on the sender's CUDA stream after the training thread's gather
        while a version from the GPU is in flight: on the default stream the training step's
        kernels would queue behind the broadcast. On CPU: just ``fn``."""
        if self._ready is None:
            return self._niced(fn, *args)
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(self._ready)
            return self._niced(fn, *args)

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """A snapshot, a rendezvous, a broadcast or the checksum of what was sent: one at a time,
        each bounded by its own timeout (the checksum by its size)."""
        return await trio.to_thread.run_sync(
            functools.partial(self._on_stream, fn, *args), limiter=self._collective_limiter
        )

    async def _http(self, fn: Callable[..., T], *args: Any) -> T:
        """One HTTP call (the client's own timeout bounds it); abandoned if its scope is cancelled."""
        return await trio.to_thread.run_sync(
            functools.partial(self._niced, fn, *args),
            limiter=self._http_limiter,
            abandon_on_cancel=True,
        )

    def _snapshot(
        self, version: int, named: Mapping[str, torch.Tensor], *, copy: bool = True
    ) -> Snapshot:
        t0 = time.monotonic()
        snap = make_snapshot(
            version,
            named,
            dtype=self.dtype,
            bucket_bytes=self.bucket_bytes,
            load_format=self.cfg.load_format,
            copy=copy,
        )
        snap.snapshot_s = time.monotonic() - t0
        return snap

    # ---- one version (the sender task) ------------------------------------------------------------

    def _event(self, name: str, **fields: Any) -> None:
        if self.on_event is not None:
            try:
                self.on_event(name, fields)
            except Exception:  # a progress callback must not break a weight update
                log.exception("weights: on_event(%s) raised", name)

    async def _sync_logged(self, snap: Snapshot) -> SyncReport:
        try:
            report = await self._sync(snap)
        except Exception as e:  # never let one version kill the sender: report and go on
            log.exception("weights: version %d failed", snap.version)
            report = SyncReport(version=snap.version, nbytes=snap.nbytes, error=repr(e))
        self.reports.append(report)
        self._note_metrics(report)
        self._event("synced", version=snap.version, report=report)
        return report

    async def _sync(self, snap: Snapshot) -> SyncReport:
        t0 = time.monotonic()
        report = SyncReport(version=snap.version, nbytes=snap.nbytes, snapshot_s=snap.snapshot_s)
        await self._preflight(report)
        paused: dict[str, float] = {}
        received: list[Member] = []
        try:
            for attempt in range(1, 4):
                report.attempts = attempt
                members = self._active()
                if not members:
                    report.error = "no generators"
                    break
                try:
                    await self._build_groups(members, report)
                    await self._pause(members, paused)
                    received = await self._send(snap, members, paused, report)
                    break
                except _Failed as e:
                    if not e.culprits or any(
                        not why.startswith("refused: ") for why in e.culprits.values()
                    ):  # a refusal has its own line (_say_refused)
                        log.warning("weights: version %d attempt %d: %s", snap.version, attempt, e)
                    for url, why in e.culprits.items():
                        self._drop(url, why, report)
                    await self._abort_attempt(self._active())
            else:
                report.error = "gave up after 3 attempts"
        finally:
            await self._resume(paused, report)
        if not report.error:
            for m in received:
                if m.state not in ("joining", "member"):  # removed meanwhile
                    continue
                m.version = snap.version
                m.state = "member"
                report.updated.append(m.url)
        report.sync_s = time.monotonic() - t0
        if self.verify and self.cfg.verify != "off" and report.updated:
            await self._verify(snap, report)
        return report

    def _active(self) -> list[Member]:
        with self._lock:
            return [m for m in self._members.values() if m.state in ("joining", "member")]

    async def _fan_out(
        self, members: list[Member], fn: Callable[[Member], Any], timeout: float
    ) -> tuple[dict[str, Any], dict[str, GeneratorError | Exception]]:
        """Run ``fn`` for every member concurrently; results and failures by url (bounded wait)."""
        _, ok, bad = await self._beside(members, fn, None, lambda _: timeout)
        return ok, bad

    async def _beside(
        self,
        members: list[Member],
        fn: Callable[[Member], Any],
        collective: Callable[[], Any] | None,
        bound: Callable[[Any], float],
    ) -> tuple[Any, dict[str, Any], dict[str, GeneratorError | Exception]]:
        """Run ``fn`` for every member concurrently (a task each, its call in a worker thread)
        while rank 0's ``collective`` runs (the servers' calls return only once it is done); then
        give them ``bound(its result)`` more seconds. Returns the collective's result (or its
        exception), and the members' results and failures by url: who has not answered failed."""
        ok: dict[str, Any] = {}
        bad: dict[str, GeneratorError | Exception] = {}

        async def one(m: Member) -> None:
            try:
                ok[m.url] = await self._http(fn, m)
            except Exception as e:
                bad[m.url] = e

        result: Any = None
        async with trio.open_nursery() as nursery:
            for m in members:
                nursery.start_soon(one, m, name=f"weights-http {m.url}")
            if collective is not None:
                try:
                    result = await self._in_thread(collective)
                except Exception as e:
                    result = e
            wait_s = bound(result)
            nursery.cancel_scope.deadline = trio.current_time() + wait_s
        for m in members:
            if m.url not in ok and m.url not in bad:
                bad[m.url] = GeneratorError(f"no answer within {wait_s:g}s", url=m.url, dead=True)
        return result, ok, bad

    async def _preflight(self, report: SyncReport) -> None:
        """Before a version: drop members that stopped answering, notice restarts, bring back the
        dropped ones that answer again (latest export from disk first)."""
        with self._lock:
            known = [m for m in self._members.values() if m.state != "removed"]
        quick = min(5.0, self.cfg.timeout_s)  # a dropped one that answers slowly is not back yet

        def probe(m: Member) -> str | None:
            if m.state == "dropped":
                return "up" if m.client.health(timeout_s=quick) else None
            return m.client.weight_version()

        ok, bad = await self._fan_out(known, probe, timeout=self.cfg.timeout_s + 1)
        for m in known:
            if m.url in bad:
                if m.state != "dropped":
                    self._drop(m.url, f"preflight: {bad[m.url]}", report)
            elif m.state == "dropped":
                if ok[m.url] == "up":
                    await self._rejoin(m, report)
            elif m.state == "member" and parse_version_label(ok[m.url]) != m.version:
                log.warning(
                    "weights: %s reports version %r, expected %s: it restarted; rejoining",
                    m.url,
                    ok[m.url],
                    m.version,
                )
                await self._rejoin(m, report)

    async def _rejoin(self, m: Member, report: SyncReport) -> None:
        """A generator is back: ask its settings (it may have been relaunched with others: a
        refused one stays out and gets nothing), load the newest exported checkpoint, then join at
        this version.

        Only exports older than the version are complete (the learner exports a version after it
        hands it to :meth:`publish`) and the current run's (a learner resumed from a checkpoint
        leaves the lost run's newer exports on disk until it overwrites them): the label it gets
        is then the version it holds."""
        version = report.version
        try:
            ranks = await self._http(self._server_ranks, m)
        except Refused as e:
            said = m.state == "dropped" and m.refused == e.message
            m.refused = e.message
            if m.state != "dropped":
                self._drop(m.url, f"refused: {e.message}", report)
            elif not said:
                _say_refused(m.url, e.message)
            return
        except GeneratorError as e:
            self._drop(m.url, f"server_info: {e}", report)
            return
        m.ranks, m.refused = ranks, ""
        exp = latest_export(self.export_dir, at_most=version - 1)
        if exp is not None:
            path, v = exp
            try:
                load = functools.partial(m.client.update_from_disk, weight_version=str(v))
                await self._http(load, str(path))
                m.version = v
                log.info("weights: %s loaded %s (version %d) from disk", m.url, path, v)
            except GeneratorError as e:
                log.warning("weights: %s could not load %s: %s; it stays dropped", m.url, path, e)
                return
        await self._drop_groups([m.url], background=True)  # it joins with a new one
        with self._lock:
            m.state, m.reason = "joining", ""
        self._event("rejoining", url=m.url, export=str(exp[0]) if exp else None)

    def _drop(self, url: str, why: str, report: SyncReport) -> None:
        with self._lock:
            m = self._members.get(url)
            if m is None or m.state in ("dropped", "removed"):
                return
            m.state, m.reason = "dropped", why
        report.dropped.append(url)
        if m.refused:
            _say_refused(url, m.refused)
        else:
            log.warning("weights: dropped generator %s: %s", url, why)
        self._event("dropped", url=url, reason=why, version=report.version)

    # ---- the process group -----------------------------------------------------------------------

    def _backend_for(
        self, members: list[Member], *, cuda: bool | None = None, gpu: str | None = None
    ) -> str:
        """The backend of a group over ``members``: ``weights.backend``, where ``auto`` is gloo as
        soon as one member cannot join NCCL (a built-in engine on CPU, or on rank 0's own GPU, as
        its ``/server_info`` reports: NCCL would fail every version), else NCCL on a CUDA machine
        (:func:`rendezvous.default_backend`). ``cuda``: whether CUDA is available (None: ask
        torch); ``gpu``: rank 0's GPU UUID (None: :attr:`sender_gpu`)."""
        if self.cfg.backend != "auto":
            return self.cfg.backend
        gpu = self.sender_gpu if gpu is None else gpu
        gloo_member = any(m.needs_gloo(gpu) for m in members)
        return rendezvous.default_backend(gloo_member=gloo_member, cuda=cuda)

    async def _build_groups(self, members: list[Member], report: SyncReport) -> None:
        """Give every member without a weight group its own, and leave the groups of those no
        longer here: every new server's init posted concurrently while rank 0 joins all of their
        groups at once (the server calls return only once rank 0 has joined), so a server that
        never comes fails its own group alone. One port for all the groups of a build: rank 0's
        TCPStore is multi-tenant and each group's keys are under its own name."""
        await self._drop_groups([u for u in self._groups if u not in {m.url for m in members}])
        new = [m for m in members if m.url not in self._groups]
        if not new:
            return
        await self._ask_ranks(new)
        self._builds += 1
        host = self.cfg.master_addr
        port = (
            self.cfg.master_port + (self._builds - 1) % 16
            if self.cfg.master_port
            else free_port(host)
        )
        layouts = {m.url: rendezvous.group_layout([m.ranks or 1]) for m in new}
        specs = {
            m.url: GroupSpec(
                master_address=host,
                master_port=port,
                world_size=layouts[m.url][1],
                group_name=f"{self.cfg.group_name}-{self._nonce}-{self._builds}-{i}",
                backend=self._backend_for([m]),
                timeout_s=self.cfg.timeout_s,
            )
            for i, m in enumerate(new)
        }
        joined, _, bad = await self._beside(
            new,
            lambda m: m.client.init_group(specs[m.url], rank_offset=layouts[m.url][0][0]),
            functools.partial(self._join_groups, specs),
            lambda _: self._survivor_s + 5,
        )
        if isinstance(joined, Exception):  # not a rendezvous' failure (each is caught): a bug
            joined = {u: joined for u in specs}
        culprits: dict[str, str] = {}
        for url, spec in specs.items():
            pg = joined.get(url)
            if url in bad or not isinstance(pg, dist.ProcessGroup):
                if isinstance(pg, dist.ProcessGroup):
                    self._abandon(pg)
                culprits[url] = f"init: {bad.get(url) or pg}".splitlines()[0][:300]
                continue
            self._groups[url] = _Group(pg=pg, spec=spec)
            report.group_builds += 1
            log.info(
                "weights: group %s built for %s: world %d on %s:%d",
                spec.group_name,
                url,
                spec.world_size,
                host,
                port,
            )
            self._event(
                "group_built",
                url=url,
                group=spec.group_name,
                world_size=spec.world_size,
                port=port,
            )
        if culprits:
            raise _Failed(culprits, f"{len(culprits)} of {len(specs)} group builds failed")

    def _join_groups(self, specs: Mapping[str, GroupSpec]) -> dict[str, Any]:
        """Rank 0's rendezvous in every group of ``specs`` at once, a thread each (each waits for
        its server's ranks, up to ``timeout_s``): the new group, or the exception, by url."""

        def join(spec: GroupSpec) -> Any:
            try:
                return rendezvous.init_custom_process_group(
                    master_address=spec.master_address,
                    master_port=spec.master_port,
                    rank=0,
                    world_size=spec.world_size,
                    group_name=spec.group_name,
                    backend=spec.backend,
                    timeout_s=spec.timeout_s,
                )
            except Exception as e:
                return e

        with ThreadPoolExecutor(max_workers=len(specs)) as pool:
            futures = {url: pool.submit(join, spec) for url, spec in specs.items()}
            return {url: f.result() for url, f in futures.items()}

    async def _ask_ranks(self, members: list[Member]) -> None:
        """Each new member's rank count from its ``/server_info`` (a TP-4 SGLang server takes 4): a
        worker cannot know it, and a wrong count hangs the group's rendezvous. Those refused
        (:meth:`_server_ranks`) are dropped before any group or weights."""
        new = [m for m in members if m.ranks is None]
        ok, bad = await self._fan_out(new, self._server_ranks, timeout=self.cfg.timeout_s + 1)
        why: dict[str, str] = {}
        for m in new:
            e = bad.get(m.url)
            if m.url in ok:
                m.ranks = ok[m.url]
            elif isinstance(e, Refused):
                m.refused = e.message
                why[m.url] = f"refused: {e.message}"
            elif e is not None:
                why[m.url] = f"server_info: {e}"
        if why:
            raise _Failed(why, "; ".join(f"{u}: {w}" for u, w in why.items()))

    def _server_ranks(self, m: Member) -> int:
        """The ranks ``m`` takes in the group, from its ``/server_info`` (None: no such endpoint),
        and where it receives (:attr:`Member.device`, :attr:`Member.gpu_uuid`); :class:`Refused`
        if it cannot take these updates: a radix cache with ``pause_mode: in_place`` (:func:`rendezvous.radix_cache_problem`, what ``asyncrl doctor``
        checks), or a layout SGLang cannot join."""
        info = m.client.server_info()
        if info is None:
            return m.info.world_size
        device, gpu = info.get("device"), info.get("gpu_uuid")
        m.device = device if isinstance(device, str) else None
        m.gpu_uuid = gpu if isinstance(gpu, str) else None
        problem = rendezvous.radix_cache_problem(info, self.cfg.pause_mode)
        if problem is None:
            try:
                return rendezvous.server_ranks(info)
            except rendezvous.LayoutError as e:
                problem = str(e)
        raise Refused(problem)

    async def _drop_groups(
        self, urls: list[str], *, background: bool = True, tell: bool = True
    ) -> None:
        """Leave the groups of ``urls``: their servers destroy their side (best effort; not
        ``tell``: a server that just failed in its group, which would answer only once that group
        timed out), rank 0 destroys its own."""
        gone = {u: g for u in urls if (g := self._groups.pop(u, None)) is not None}
        if not gone:
            return
        with self._lock:
            members = [self._members[u] for u in gone if u in self._members] if tell else []
        quick = min(5.0, self.cfg.timeout_s)
        await self._fan_out(
            members,
            lambda m: m.client.destroy_group(gone[m.url].spec.group_name, timeout_s=quick),
            quick + 1,
        )
        for g in gone.values():
            if background:
                self._abandon(g.pg)
            else:
                await self._in_thread(rendezvous.destroy_process_group, g.pg)

    def _abandon(self, pg: dist.ProcessGroup) -> None:
        """Destroy a group whose peers may be gone. Gloo's shutdown waits for a stuck collective to
        time out, so it runs as a background task nobody waits for (group names are never reused),
        its thread left behind when the sender stops; an NCCL group is aborted first
        (rendezvous.abandon_process_group)."""
        assert self._background is not None
        abandon = functools.partial(
            trio.to_thread.run_sync, rendezvous.abandon_process_group, pg, abandon_on_cancel=True
        )
        self._background.start_soon(abandon, name="weights-abandon-group")

    async def _unhealthy(self, members: list[Member]) -> dict[str, str]:
        quick = min(5.0, self.cfg.timeout_s)
        ok, bad = await self._fan_out(
            members, lambda m: m.client.health(timeout_s=quick), quick + 1
        )
        return {u: "health check failed" for u, up in ok.items() if not up} | {
            u: f"health check: {e}" for u, e in bad.items()
        }

    # ---- pause, send, resume ---------------------------------------------------------------------

    async def _pause(self, members: list[Member], paused: dict[str, float]) -> None:
        """Pause (in place) and open a session on every member; failures raise :class:`_Failed`.

        The built-in engine is not paused: it receives into a staging copy while it decodes and
        swaps between two decode steps at ``/end_weight_update``, so its pause is the swap alone."""

        def pause(m: Member) -> None:
            if m.info.kind != "builtin" and m.url not in paused:
                m.client.pause(self.cfg.pause_mode)
                paused[m.url] = time.monotonic()
            m.sessions = m.client.begin()

        _, bad = await self._fan_out(members, pause, timeout=self.cfg.timeout_s + 5)
        if bad:
            raise _Failed({u: f"pause/begin: {e}" for u, e in bad.items()}, "pause/begin failed")

    async def _send(
        self, snap: Snapshot, members: list[Member], paused: dict[str, float], report: SyncReport
    ) -> list[Member]:
        """Every bucket: HTTP update calls to all members concurrently with rank 0's broadcasts
        into their groups. A member whose broadcast or call fails is dropped there and its group
        abandoned; the others take the next bucket. Returns those that received the version
        (raises :class:`_Failed` when none is left)."""
        live = list(members)
        n = len(snap.buckets)
        for i, (bucket, payload) in enumerate(zip(snap.buckets, snap.payloads, strict=True)):
            meta = bucket.meta()
            version = str(snap.version) if i == n - 1 else None
            groups = {m.url: self._groups[m.url] for m in live}

            def update(m: Member, meta=meta, version=version, groups=groups) -> None:
                # SGLang's radix cache still holds prefixes computed by the old weights, and new
                # requests would reuse them under the new version's label. After a retract pause
                # nothing is resident, so the last bucket flushes it (the built-in engine has none).
                flush = (
                    version is not None
                    and self.cfg.pause_mode == "retract"
                    and m.info.kind != "builtin"
                )
                m.client.update_from_distributed(
                    meta,
                    group_name=groups[m.url].spec.group_name,
                    load_format=self.cfg.load_format,
                    weight_version=version,
                    flush_cache=flush,
                    timeout_s=self._survivor_s,
                )

            def broadcast(payload=payload, groups=groups) -> tuple[dict[str, str], float]:
                t = time.monotonic()
                pgs = {u: g.pg for u, g in groups.items()}
                return self._broadcast(pgs, payload), time.monotonic() - t

            t0 = time.monotonic()
            # a member whose group failed answers only once that group timed out: it is dropped
            # whatever it answers, and the others answered as soon as their broadcast was in
            result, _, bad = await self._beside(
                live, update, broadcast, lambda _: self.cfg.timeout_s
            )
            if isinstance(result, Exception):  # not a broadcast's failure (each is caught): a bug
                result = ({u: f"broadcast: {result}" for u in groups}, 0.0)
            errors, t_bcast = result
            culprits = {u: f"bucket {i + 1}/{n}: {e}" for u, e in errors.items()}
            for url, e in bad.items():
                culprits.setdefault(url, f"bucket {i + 1}/{n}: update: {e}")
            live = await self._drop_failed(live, culprits, report)
            if not live:
                raise _Failed({}, f"bucket {i + 1}/{n}: every generator failed")
            self._event(
                "bucket_sent",
                version=snap.version,
                index=i,
                count=n,
                nbytes=bucket.nbytes,
                broadcast_s=t_bcast,
                total_s=time.monotonic() - t0,
            )
        ended, bad = await self._fan_out(
            [m for m in live if m.sessions], lambda m: m.client.end(), self.cfg.timeout_s + 5
        )
        live = await self._drop_failed(live, {u: f"end: {e}" for u, e in bad.items()}, report)
        for url, reply in ended.items():  # the built-in engine's swap: its whole pause
            if isinstance(reply.get("pause_s"), int | float) and url not in paused:
                report.pause_s[url] = float(reply["pause_s"])
        return live

    async def _drop_failed(
        self, live: list[Member], culprits: dict[str, str], report: SyncReport
    ) -> list[Member]:
        """Drop ``culprits`` in the middle of a version and abandon their groups; the rest of
        ``live``, which go on with it."""
        if not culprits:
            return live
        log.warning(
            "weights: version %d: %s",
            report.version,
            "; ".join(f"{u}: {why}" for u, why in culprits.items()),
        )
        for url, why in culprits.items():
            self._drop(url, why, report)
        await self._drop_groups(list(culprits), tell=False)
        return [m for m in live if m.url not in culprits]

    async def _abort_attempt(self, survivors: list[Member]) -> None:
        """After a failed attempt (a build, a pause: before any bucket went out): close the
        survivors' sessions (best effort); their groups stay for the next attempt."""
        quick = min(5.0, self.cfg.timeout_s)
        with_session = [m for m in survivors if m.sessions]
        await self._fan_out(with_session, lambda m: m.client.end(), quick + 1)

    def _broadcast(
        self, groups: Mapping[str, dist.ProcessGroup], payload: list[torch.Tensor]
    ) -> dict[str, str]:
        """Rank 0's broadcasts of one bucket into ``groups``, bounded by ``timeout_s``: an error
        message by url for the groups that failed."""
        return broadcast_bucket(groups, payload, self.cfg.timeout_s)

    async def _resume(self, paused: dict[str, float], report: SyncReport) -> None:
        """Continue every generator this version paused, dropped ones too (a generator dropped for
        refusing an update is alive, and its requests must not stay frozen)."""
        with self._lock:
            targets = [self._members[u] for u in paused]

        def cont(m: Member) -> None:
            m.client.resume()
            report.pause_s[m.url] = time.monotonic() - paused[m.url]

        _, bad = await self._fan_out(targets, cont, timeout=self.cfg.timeout_s + 5)
        for url, e in bad.items():
            self._drop(url, f"continue_generation: {e}", report)

    # ---- verification and metrics ----------------------------------------------------------------

    async def _verify(self, snap: Snapshot, report: SyncReport) -> None:
        """Ask every updated generator for its version and checksum; compare with what was sent.

        The checksum of what was sent runs in a worker thread, as the broadcast does (on the
        sender's stream, niced): in the control plane's loop it would hold the buffer service's
        requests for as long as it hashes (a full checksum reads every weight)."""
        sample = VERIFY_SAMPLE if self.cfg.verify == "sampled" else 0
        report.checksum = await self._in_thread(
            functools.partial(buckets.checksum, snap.named(), sample=sample)
        )
        members = [self._members[u] for u in report.updated]

        def check(m: Member) -> tuple[str | None, str | None]:
            return m.client.weight_version(), m.client.checksum(sample=sample)

        ok, bad = await self._fan_out(members, check, timeout=self.cfg.timeout_s + 5)
        for url, (version, checksum) in ok.items():
            report.reported[url] = version
            report.checksum_ok[url] = None if checksum is None else checksum == report.checksum
        for url, e in bad.items():
            report.reported[url] = None
            report.checksum_ok[url] = None
            log.warning("weights: could not verify %s: %s", url, e)
        for url in report.mismatches:
            log.error(
                "weights: %s after version %d: reports version %r, checksum %s",
                url,
                snap.version,
                report.reported.get(url),
                "matches" if report.checksum_ok.get(url) else "DIFFERS",
            )

    def _note_metrics(self, r: SyncReport) -> None:
        with self._lock:
            members = [m for m in self._members.values() if m.state != "removed"]
        lags = [r.version - (m.version or 0) for m in members]
        values: dict[str, Any] = {
            metric_names.WEIGHT_SYNC_S: r.sync_s,
            "weights/bytes": r.nbytes,
            "weights/snapshot_s": r.snapshot_s,
            "weights/generators": sum(m.state == "member" for m in members),
            "weights/dropped": len(r.dropped),
            "weights/dropped_total": sum(m.state == "dropped" for m in members),
            "weights/version_lag/max": max(lags, default=0),
            "weights/version_lag/mean": sum(lags) / len(lags) if lags else 0.0,
            "weights/checksum_mismatch": len(r.mismatches),
            "weights/attempts": r.attempts,
            "weights/failed": int(bool(r.error)),
        }
        if r.sync_s > 0:
            values["weights/gbps"] = r.nbytes / r.sync_s / 1e9
        for url, s in r.pause_s.items():
            values[f"{metric_names.PAUSE_S}{url.split('://')[-1]}"] = s
        if r.pause_s:
            values["weights/pause_s/max"] = max(r.pause_s.values())
        self._metrics.update(values)
        self._metrics["weights/version"] = r.version
