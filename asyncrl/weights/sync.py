"""One version's sync: every generator paused in place, the buckets out, generation continued, and
each generator asked what it now holds.

Per version (docs/design.md §4): a preflight drops the generators that stopped answering and brings
back the dropped ones that answer again (the latest exported HF checkpoint from disk first, then a
new group). Then, up to three attempts: build the missing groups, pause every generator and open a
session (``/begin_weight_update``; 404 on old SGLang: no session), send the buckets (one
``/update_weights_from_distributed`` call per bucket, posted concurrently with rank 0's broadcast
of that bucket into every group; a generator on rank 0's own device takes
``/update_weights_from_tensor`` with a handle to the bucket instead, asyncrl.weights.ipc), close the
sessions. A generator that fails or does not answer is
dropped and its group abandoned; the others go on with the same version, in the same attempt. Every
paused generator is continued, dropped ones too. Last, each is asked which version it holds and for
its checksum, compared with the checksum of what was sent.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from asyncrl.generator_http import GeneratorError, parse_version_label
from asyncrl.recipe import WeightsConfig
from asyncrl.weights import adapters, buckets, ipc
from asyncrl.weights.exports import is_adapter_export, latest_export
from asyncrl.weights.fanout import Failed, FanOut
from asyncrl.weights.members import Member, Members
from asyncrl.weights.process_groups import Groups, Refused, ask_server, broadcast_bucket
from asyncrl.weights.snapshot import Snapshot

log = logging.getLogger("asyncrl.weights")

VERIFY_SAMPLE = 4096
"""Values per tensor the ``sampled`` verification hashes on both sides (weights.verify)."""

ATTEMPTS = 3
"""Tries of one version: a failed build or pause drops its culprits, and the rest try again."""


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


def say_refused(url: str, problem: str) -> None:
    log.error("weights: generator %s refused, no weights sent to it: %s", url, problem)


class Sync:
    """Sends versions to the members over their groups (the sender task's; one version at a time).

    ``verify``: ask each generator for its version and checksum after a version (unless
    ``weights.verify`` is off). ``export_dir``: where a rejoining generator's checkpoint comes from.
    ``on_event(name, **fields)``: the broadcaster's progress callback."""

    def __init__(
        self,
        cfg: WeightsConfig,
        members: Members,
        groups: Groups,
        fanout: FanOut,
        *,
        export_dir: Path | None,
        verify: bool,
        on_event: Callable[..., None],
        by_name: adapters.ByName | None = None,
    ):
        self.cfg = cfg
        self.members = members
        self.groups = groups
        self.fanout = fanout
        self.export_dir = export_dir
        self.verifies = verify  # may be changed between versions (tools/bench/weights.py)
        self.on_event = on_event
        self.by_name = by_name  # LoRA: SGLang loads each version's adapter by name (adapters.py)
        # url -> buffers handed to it by handle with no answer yet (it may still be copying):
        # kept until it opens a new session, whatever happens to their version's snapshot
        self.pinned: dict[str, list[torch.Tensor]] = {}

    async def run(self, snap: Snapshot) -> SyncReport:
        """Send ``snap``; never raises (a failure is the report's ``error``)."""
        try:
            return await self._sync(snap)
        except Exception as e:  # never let one version kill the sender: report and go on
            log.exception("weights: version %d failed", snap.version)
            return SyncReport(version=snap.version, nbytes=snap.nbytes, error=repr(e))

    async def _sync(self, snap: Snapshot) -> SyncReport:
        t0 = time.monotonic()
        report = SyncReport(version=snap.version, nbytes=snap.nbytes, snapshot_s=snap.snapshot_s)
        await self._preflight(report)
        paused: dict[str, float] = {}
        received: list[Member] = []
        names = [n for b in snap.buckets for n in b.names]
        by_name = [m for m in self.members.active() if adapters.ByName.takes(m, names)]
        if by_name:
            if self.by_name is None:
                raise ValueError("SGLang takes LoRA versions by name: WeightBroadcaster(lora=...)")
            received, bad = await self.by_name.send(snap, by_name)
            for url, why in bad.items():
                self._drop(url, why, report)
        try:
            for attempt in range(1, ATTEMPTS + 1):
                report.attempts = attempt
                members = [m for m in self.members.active() if all(m is not x for x in by_name)]
                if not members:
                    report.error = "" if by_name else "no generators"
                    break
                built = self.groups.built
                try:
                    await self.groups.build(members)
                    await self._pause(members, paused)
                    received += await self._send(snap, members, paused, report)
                    break
                except Failed as e:
                    if not e.culprits or any(
                        not why.startswith("refused: ") for why in e.culprits.values()
                    ):  # a refusal has its own line (say_refused)
                        # str(e): a record that kept the exception would keep its traceback's
                        # frames, and so this version's buffers (a handle's too) alive
                        log.warning(
                            "weights: version %d attempt %d: %s", snap.version, attempt, str(e)
                        )
                    for url, why in e.culprits.items():
                        self._drop(url, why, report)
                    await self._abort_attempt(self.members.active())
                finally:
                    report.group_builds += self.groups.built - built
            else:
                report.error = f"gave up after {ATTEMPTS} attempts"
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
        if self.verifies and self.cfg.verify != "off" and report.updated:
            await self.verify(snap, report)
        return report

    async def _preflight(self, report: SyncReport) -> None:
        """Before a version: drop members that stopped answering, notice restarts, bring back the
        dropped ones that answer again (latest export from disk first)."""
        known = self.members.known()
        for url in set(self.pinned) - {m.url for m in known}:  # removed: nothing more to answer
            del self.pinned[url]
        quick = min(5.0, self.cfg.timeout_s)  # a dropped one that answers slowly is not back yet

        async def probe(m: Member) -> str | None:
            if m.state == "dropped":
                return "up" if await m.client.health(timeout_s=quick) else None
            return await m.client.weight_version()

        ok, bad = await self.fanout.each(known, probe, timeout=self.cfg.timeout_s + 1)
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
        hands it to the broadcaster) and the current run's (a learner resumed from a checkpoint
        leaves the lost run's newer exports on disk until it overwrites them): the label it gets
        is then the version it holds."""
        version = report.version
        try:
            ranks = await ask_server(m, self.cfg.pause_mode)
        except Refused as e:
            said = m.state == "dropped" and m.refused == e.message
            m.refused = e.message
            if m.state != "dropped":
                self._drop(m.url, f"refused: {e.message}", report)
            elif not said:
                say_refused(m.url, e.message)
            return
        except GeneratorError as e:
            self._drop(m.url, f"server_info: {e}", report)
            return
        m.ranks, m.refused = ranks, ""
        exp = latest_export(self.export_dir, at_most=version - 1)
        if exp is not None:
            path, v = exp
            try:
                if is_adapter_export(path) and m.info.kind != "builtin":
                    await adapters.load(m, path, v)  # SGLang serves an adapter export by name
                else:
                    await m.client.update_from_disk(str(path), weight_version=str(v))
                m.version = v
                log.info("weights: %s loaded %s (version %d) from disk", m.url, path, v)
            except GeneratorError as e:
                log.warning("weights: %s could not load %s: %s; it stays dropped", m.url, path, e)
                return
        await self.groups.drop([m.url], background=True)  # it joins with a new one
        self.members.rejoin(m)
        self.on_event("rejoining", url=m.url, export=str(exp[0]) if exp else None)

    def _handles(
        self, bucket: buckets.Bucket, payload: list[torch.Tensor], meta: dict, members: list[Member]
    ) -> tuple[torch.Tensor, dict[str, str]]:
        """One bucket's buffer (the snapshot's own in the ``flattened_bucket`` layout, else a
        flattened copy) and a handle to it per member (worker thread, on the sender's stream: a
        CUDA handle's event follows the writes of that buffer). On the CPU the buffer must be in
        shared memory: made there (``weights.backend: ipc``, or the copy), else moved (a copy)."""
        flat = payload[0] if self.cfg.load_format == "flattened_bucket" else None
        if flat is None:
            flat = buckets.flatten(bucket.tensors, shared=True)
        ipc.share(flat)
        return flat, {m.url: ipc.payload(flat, meta) for m in members}

    def _drop(self, url: str, why: str, report: SyncReport) -> None:
        m = self.members.drop(url, why)
        if m is None:
            return
        report.dropped.append(url)
        if m.refused:
            say_refused(url, m.refused)
        else:
            log.warning("weights: dropped generator %s: %s", url, why)
        self.on_event("dropped", url=url, reason=why, version=report.version)

    async def _pause(self, members: list[Member], paused: dict[str, float]) -> None:
        """Pause (in place) and open a session on every member; failures raise :class:`Failed`.

        The built-in engine is not paused: it receives into a staging copy while it decodes and
        swaps between two decode steps at ``/end_weight_update``, so its pause is the swap alone."""

        async def pause(m: Member) -> None:
            if m.info.kind != "builtin" and m.url not in paused:
                await m.client.pause(self.cfg.pause_mode)
                paused[m.url] = time.monotonic()
            # one that takes buckets by handle joins no group, whose build would discard a session
            # left open by an update given up on: a joining one discards it here
            fresh = m.state == "joining" and self.groups.by_handle(m.url)
            m.sessions = await m.client.begin(abandon_open=fresh)
            # its session runs under the engine's weight lock, after any copy still under way
            self.pinned.pop(m.url, None)

        _, bad = await self.fanout.each(members, pause, timeout=self.cfg.timeout_s + 5)
        if bad:
            raise Failed({u: f"pause/begin: {e}" for u, e in bad.items()}, "pause/begin failed")

    async def _send(
        self, snap: Snapshot, members: list[Member], paused: dict[str, float], report: SyncReport
    ) -> list[Member]:
        """Every bucket: HTTP update calls to all members concurrently with rank 0's broadcasts
        into their groups; a member that takes buckets by handle (``ipc``) gets one to the
        bucket's flattened buffer in its call instead. A member whose broadcast or call fails is
        dropped there and its group abandoned; the others take the next bucket. Returns those
        that received the version (raises :class:`Failed` when none is left)."""
        live = list(members)
        n = len(snap.buckets)
        for i, (bucket, payload) in enumerate(zip(snap.buckets, snap.payloads, strict=True)):
            meta = bucket.meta()
            version = str(snap.version) if i == n - 1 else None
            groups = {m.url: self.groups[m.url] for m in live if not self.groups.by_handle(m.url)}
            handles = [m for m in live if self.groups.by_handle(m.url)]
            flat, payloads = (
                await self.fanout.in_thread(self._handles, bucket, payload, meta, handles)
                if handles
                else (None, {})
            )

            async def update(
                m: Member, meta=meta, version=version, groups=groups, payloads=payloads
            ) -> None:
                # SGLang's radix cache still holds prefixes computed by the old weights, and new
                # requests would reuse them under the new version's label. After a retract pause
                # nothing is resident, so the last bucket flushes it (the built-in engine has none).
                flush = (
                    version is not None
                    and self.cfg.pause_mode == "retract"
                    and m.info.kind != "builtin"
                )
                if m.url in payloads:  # no group to wait on: its own bound
                    await m.client.update_from_tensor(
                        [payloads[m.url]],
                        weight_version=version,
                        flush_cache=flush,
                        timeout_s=self.cfg.timeout_s,
                    )
                    return
                await m.client.update_from_distributed(
                    meta,
                    group_name=groups[m.url].spec.group_name,
                    load_format=self.cfg.load_format,
                    weight_version=version,
                    flush_cache=flush,
                    timeout_s=self.groups.survivor_s,
                )

            def broadcast(payload=payload, groups=groups) -> tuple[dict[str, str], float]:
                t = time.monotonic()
                pgs = {u: g.pg for u, g in groups.items()}
                return broadcast_bucket(pgs, payload, self.cfg.timeout_s), time.monotonic() - t

            t0 = time.monotonic()
            # a member whose group failed answers only once that group timed out: it is dropped
            # whatever it answers, and the others answered as soon as their broadcast was in
            result, _, bad = await self.fanout.beside(
                live,
                update,
                broadcast if groups else None,
                lambda _: self.cfg.timeout_s,
                lambda r: r[0] if isinstance(r, tuple) else (),  # their broadcast's errors
            )
            if result is None:  # no group: every member took this bucket by handle
                result = ({}, 0.0)
            for m in handles:
                e = bad.get(m.url)
                if e is not None and not (isinstance(e, GeneratorError) and e.status is not None):
                    # no answer: it may still be copying out of the buffer, which stays rank 0's
                    # until it answers again (a new session, :meth:`_pause`)
                    self.pinned.setdefault(m.url, []).append(flat)
            if isinstance(result, Exception):  # not a broadcast's failure (each is caught): a bug
                result = ({u: f"broadcast: {result}" for u in groups}, 0.0)
            errors, t_bcast = result
            culprits = {u: f"bucket {i + 1}/{n}: {e}" for u, e in errors.items()}
            for url, e in bad.items():
                culprits.setdefault(url, f"bucket {i + 1}/{n}: update: {e}")
            live = await self._drop_failed(live, culprits, report)
            if not live:
                raise Failed({}, f"bucket {i + 1}/{n}: every generator failed")
            self.on_event(
                "bucket_sent",
                version=snap.version,
                index=i,
                count=n,
                nbytes=bucket.nbytes,
                broadcast_s=t_bcast,
                total_s=time.monotonic() - t0,
            )
        ended, bad = await self.fanout.each(
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
        await self.groups.drop(list(culprits), tell=False)
        return [m for m in live if m.url not in culprits]

    async def _abort_attempt(self, survivors: list[Member]) -> None:
        """After a failed attempt (a build, a pause: before any bucket went out): close the
        survivors' sessions (best effort); their groups stay for the next attempt."""
        quick = min(5.0, self.cfg.timeout_s)
        with_session = [m for m in survivors if m.sessions]
        await self.fanout.each(with_session, lambda m: m.client.end(), quick + 1)

    async def _resume(self, paused: dict[str, float], report: SyncReport) -> None:
        """Continue every generator this version paused, dropped ones too (a generator dropped for
        refusing an update is alive, and its requests must not stay frozen)."""
        targets = self.members.these(list(paused))

        async def cont(m: Member) -> None:
            await m.client.resume()
            report.pause_s[m.url] = time.monotonic() - paused[m.url]

        _, bad = await self.fanout.each(targets, cont, timeout=self.cfg.timeout_s + 5)
        for url, e in bad.items():
            self._drop(url, f"continue_generation: {e}", report)

    async def verify(self, snap: Snapshot, report: SyncReport) -> None:
        """Ask every updated generator for its version and checksum; compare with what was sent.

        The checksum of what was sent runs in a worker thread, as the broadcast does (on the
        sender's stream, niced): in the control plane's loop it would hold the buffer service's
        requests for as long as it hashes (a full checksum reads every weight)."""
        sample = VERIFY_SAMPLE if self.cfg.verify == "sampled" else 0
        report.checksum = await self.fanout.in_thread(
            functools.partial(buckets.checksum, snap.named(), sample=sample)
        )
        members = self.members.these(report.updated)

        async def check(m: Member) -> tuple[str | None, str | None]:
            return await m.client.weight_version(), await m.client.checksum(sample=sample)

        ok, bad = await self.fanout.each(members, check, timeout=self.cfg.timeout_s + 5)
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
