"""The versioned weight broadcaster: learner rank 0 pushes each new policy version to every generator.

This module is the training thread's face of the weight path; the parts it puts together are
modules of their own: what a version sends (:mod:`asyncrl.weights.snapshot`), the registered
generators (:mod:`asyncrl.weights.members`), one weight group per generator
(:mod:`asyncrl.weights.process_groups`), HTTP calls beside rank 0's collective
(:mod:`asyncrl.weights.fanout`), one version's sync with its retries and verification
(:mod:`asyncrl.weights.sync`, docs/design.md §4) and the sender's state machine
(:mod:`asyncrl.weights.sender`).

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
the learner computes the next version: a task per generator for the HTTP calls (async, on one
client the sender task makes and closes), the broadcast in a worker thread, every wait in a cancel
scope. At most one version is in flight (the next publish waits for its transfer). ``overlap:
false`` sends synchronously. A hook
(``after_sync``: the held-out evaluation) may hold the generators on a version after it is out; the
learner does not wait for it: what it publishes meanwhile goes out when the hold ends, newest only.
"""

from __future__ import annotations

import functools
import logging
import math
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.distributed as dist
import trio

from asyncrl import metric_names
from asyncrl.control import ControlPlane
from asyncrl.generator_http import WeightsClient, async_client
from asyncrl.gpu import cuda_uuid
from asyncrl.recipe import LoraConfig, WeightsConfig
from asyncrl.weights import adapters, buckets
from asyncrl.weights.fanout import FanOut
from asyncrl.weights.members import Members
from asyncrl.weights.process_groups import Groups
from asyncrl.weights.sender import Sender
from asyncrl.weights.snapshot import Snapshot, cuda_ready, make_snapshot
from asyncrl.weights.sync import Sync, SyncReport
from asyncrl.wire import GeneratorInfo

log = logging.getLogger("asyncrl.weights")


class WeightBroadcaster:
    """Learner-side weight broadcaster. Construct it on every learner rank; only rank 0 sends.

    Call :meth:`on_step` after each learner step (all ranks: it takes the ``hf_state_dict()``
    collective every ``cfg.every`` versions; asyncrl/learner/main.py's loop does), or call :meth:`publish` on rank 0 with HF-named tensors.
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
        lora: LoraConfig | None = None,
    ):
        """``export_dir``: where the learner exports HF checkpoints (rejoining generators load the newest).
        ``on_event(name, fields)``: progress callback ("bucket_sent", "dropped", "synced", ...),
        called in the control plane's loop: it must be quick.
        ``after_sync(report)``: runs in a worker thread after each version, before the next one
        goes out, so the generators hold ``report.version`` while it runs (the held-out
        evaluation, asyncrl.learner.eval_schedule).
        ``plane``: the control plane whose nursery runs the sender task (rank 0); without one the
        broadcaster runs its own.
        ``lora``: the recipe's ``learner.lora``; when on, SGLang generators load each version's
        adapter by name from a PEFT folder written next to ``export_dir`` (``adapters``, beside
        ``hf``; a temporary folder without one) (asyncrl.weights.adapters)."""
        self.cfg = cfg
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = rank
        self.on_event = on_event
        self.dtype = buckets.parse_dtype(cfg.dtype)
        self.bucket_bytes = max(1, int(cfg.bucket_mb * 2**20))
        self.reports: list[SyncReport] = []
        self._metrics: dict[str, Any] = {}  # of the versions synced since take_metrics()
        self._api_key = api_key
        self._http: httpx.AsyncClient | None = None  # the sender task's (serve), rank 0's
        self.members = Members(self._client)
        self.fanout = FanOut(nice=cfg.overlap)
        # Rank 0's GPU, read here in the training thread (where the learner set its device; the
        # CUDA current device is per thread), for each group's backend, chosen from its member.
        self.groups = Groups(
            cfg,
            self.members,
            self.fanout,
            sender_gpu=cuda_uuid() if rank == 0 else None,
            on_event=self._event,
        )
        self._tmp: tempfile.TemporaryDirectory | None = None
        by_name = None
        if lora is not None and lora.enabled:
            if export_dir is not None:
                root = Path(export_dir).parent / "adapters"
            else:
                self._tmp = tempfile.TemporaryDirectory(prefix="asyncrl-adapters-")
                root = Path(self._tmp.name)
            by_name = adapters.ByName(root, lora, self.fanout, cfg.timeout_s)
        self.sync = Sync(
            cfg,
            self.members,
            self.groups,
            self.fanout,
            export_dir=Path(export_dir) if export_dir is not None else None,
            verify=verify,
            on_event=self._event,
            by_name=by_name,
        )
        self.sender = Sender(after_sync, nice=cfg.overlap)
        self._last_forced = -float("inf")
        self._closed = False
        self._plane = plane
        self._own_plane = False
        if self.rank == 0:
            if self._plane is None:
                self._plane, self._own_plane = ControlPlane("weights-sender"), True
            self._plane.start(self.serve, name="weights-sender")

    # ---- membership (any thread) -----------------------------------------------------------------

    def add_generator(self, info: GeneratorInfo) -> None:
        """Register a generator; it joins the group at the next version. A no-op on ranks other
        than 0 (they send nothing)."""
        if self.rank == 0 and self.members.add(info):
            log.info(
                "weights: generator %s registered (%s, %d rank(s))",
                info.url.rstrip("/"),
                info.kind,
                info.world_size,
            )

    def remove_generator(self, url: str) -> None:
        """Stop sending to a generator from the next version on."""
        if self.members.remove(url):
            log.info("weights: generator %s removed", url.rstrip("/"))

    def on_register(self, worker_id: str, generators: list[GeneratorInfo]) -> None:
        """The buffer service's callback: a worker's current generator list (replaces its last one)."""
        gone = self.members.replace(worker_id, {g.url.rstrip("/") for g in generators})
        for g in generators:
            self.add_generator(g)
        for url in gone:
            self.remove_generator(url)

    def generators(self) -> dict[str, str]:
        """url -> state ("joining", "member", "dropped")."""
        return dict(self.members.states())

    def dropped(self) -> dict[str, str]:
        """url -> why it is sent no weights now (dropped or refused): what the learner's wait for
        a batch names, and what a worker whose generators fell behind the bound asks for."""
        return {m.url: m.reason for m in self.members.known() if m.state == "dropped"}

    # ---- publishing (training thread) ------------------------------------------------------------

    def needs_sync(self) -> bool:
        """A registered generator waits to join and no version is in flight (rank 0). A learner
        idle for want of data then publishes its current version at once: after a learner restart,
        or with one fresh worker, that generator's tokens are too old to train on until it has the
        learner's weights, and without a step no next version would come (a deadlock)."""
        if self.sender.running:
            return False
        states = set(self.members.states().values())
        if "joining" in states:
            return True
        # A dropped one is probed (and brought back) only when a version goes out: now and then.
        return "dropped" in states and time.monotonic() - self._last_forced > self.cfg.timeout_s

    def settling(self) -> bool:
        """A generator's place is being decided (rank 0): one waits to join, or a version is on
        its way. A learner whose wait for a batch ends meanwhile waits for that verdict, as a
        generator dropped by it is the cause its message names (``source.broadcast_batch``)."""
        return self.sender.running or "joining" in set(self.members.states().values())

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
        (counted in ``sender.skipped``). A no-op on ranks other than 0.
        """
        if self.rank != 0:
            return
        if self._closed:
            raise RuntimeError("weight broadcaster is closed")
        assert self._plane is not None
        # The sender's stream waits on ``ready`` (FanOut.in_thread), so it is recorded after the
        # last kernel the sender reads from: the gather when owned (the sender copies the buckets
        # itself), else the bucket copies queued just above on this (training) stream. Recorded
        # before them, the broadcast could read a bucket whose copy had not run yet.
        if owned:
            named = dict(named_tensors)
            ready = cuda_ready(named.values())
            make = functools.partial(self._snapshot, version, named, copy=False)
        else:
            snap = self._snapshot(version, named_tensors)
            ready = cuda_ready(t for payload in snap.payloads for t in payload)
            make = lambda: snap  # noqa: E731
        job = functools.partial(self._version, ready, make)
        self._plane.run(self.sender.hand_over, version, job)
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
        self._plane.run(self.sender.hold, fn)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the in-flight broadcast; False if it is still running after ``timeout`` seconds."""
        if self._plane is None or not self._plane.alive:
            return True
        return self._plane.run(self.sender.wait_idle, math.inf if timeout is None else timeout)

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
        """Finish the in-flight broadcast, leave the group and close the HTTP client."""
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
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> WeightBroadcaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the sender task (the control plane's loop) ----------------------------------------------

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The sender task: runs each version (and hold) handed over by the training thread, one
        at a time; ends when :meth:`close` closes its channel. The generators' HTTP client is
        made here before the task has started (so before any generator is registered) and closed
        when it ends, on the loop that makes its calls."""
        http = async_client(self.cfg.timeout_s, api_key=self._api_key)
        async with http, trio.open_nursery() as background:
            self._http = http
            self.groups.background = background  # abandoned groups' teardown
            if self.sync.by_name is not None:
                self.sync.by_name.background = background  # adapters unloaded
            await self.sender.serve(task_status=task_status)
            background.cancel_scope.cancel()  # a group still being abandoned is left to its thread

    def _client(self, info: GeneratorInfo) -> WeightsClient:
        """A new member's calls, on the sender task's client."""
        assert self._http is not None, "generators are registered on rank 0, after serve() started"
        return WeightsClient(info, self._http)

    async def _version(self, ready: Any, make: Callable[[], Snapshot]) -> SyncReport:
        """One version: its snapshot (built in a worker thread when the tensors are owned), then
        its sync; on GPU the sender's stream is drained before the snapshot is released, so the
        allocator cannot hand its memory to the training stream while a broadcast still reads it."""
        self.fanout.ready = ready
        try:
            snap = await self.fanout.in_thread(make)
            report = await self.sync.run(snap)
            self.reports.append(report)
            self._note_metrics(report)
            self._event("synced", version=snap.version, report=report)
            return report
        finally:
            await self.fanout.drain()
            self.fanout.ready = None

    async def _close(self) -> None:
        members = self.members.all()
        live = {m.url for m in members if m.state == "member"}
        # a dropped one's group (not left yet) is abandoned: its server may not answer
        await self.groups.drop([u for u in self.groups.urls() if u not in live], tell=False)
        await self.groups.drop(self.groups.urls(), background=False)
        self.sender.close()  # ends serve(), which closes the HTTP client

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
            shared=self.cfg.backend == "ipc",  # CPU handles name shared memory: made there
        )
        snap.snapshot_s = time.monotonic() - t0
        return snap

    def _event(self, name: str, **fields: Any) -> None:
        if self.on_event is not None:
            try:
                self.on_event(name, fields)
            except Exception:  # a progress callback must not break a weight update
                log.exception("weights: on_event(%s) raised", name)

    def _note_metrics(self, r: SyncReport) -> None:
        members = self.members.known()
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
