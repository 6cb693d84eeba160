"""The weight process groups: one per generator (learner rank 0 and that generator's ranks).

All of a bucket's broadcasts are in flight at once, a group each: a peer that dies takes down its
own group only. SGLang builds its side of a group with a 30-minute timeout and aborts the server
when a collective in it fails (``InitWeightsUpdateGroupReqInput`` has no timeout), so in a shared
group one death would take every server with it. The price: rank 0 sends the bytes once per
generator (docs/gpu.md). Before a generator gets a group, its ``/server_info`` says how many ranks
it takes, where it receives (the group's backend) and whether it can take these updates at all.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import trio

from asyncrl.generator_http import GeneratorError, GroupSpec
from asyncrl.recipe import WeightsConfig
from asyncrl.weights import rendezvous
from asyncrl.weights.fanout import Failed, FanOut
from asyncrl.weights.members import Member, Members

log = logging.getLogger("asyncrl.weights")

K = TypeVar("K")

_MIN_WAIT_S = 0.01
"""The shortest bounded wait on a work once the bucket's deadline has passed (a last look)."""


class Refused(GeneratorError):
    """A generator whose settings cannot take this broadcaster's updates (``message``: why, and the
    fix). Nothing is sent to it while they stay so."""


async def ask_server(m: Member, pause_mode: str) -> int:
    """The ranks ``m`` takes in the group, from its ``/server_info`` (no such endpoint: its
    registered world size), and where it receives (:attr:`Member.device`, :attr:`Member.gpu_uuid`);
    :class:`Refused` if it cannot take these updates: a radix cache with ``pause_mode: in_place``
    (:func:`rendezvous.radix_cache_problem`, what ``asyncrl doctor`` checks), or a layout SGLang
    cannot join."""
    info = await m.client.server_info()
    if info is None:
        return m.info.world_size
    device, gpu = info.get("device"), info.get("gpu_uuid")
    m.device = device if isinstance(device, str) else None
    m.gpu_uuid = gpu if isinstance(gpu, str) else None
    problem = rendezvous.radix_cache_problem(info, pause_mode)
    if problem is None:
        try:
            return rendezvous.server_ranks(info)
        except rendezvous.LayoutError as e:
            problem = str(e)
    raise Refused(problem)


def backend_for(
    backend: str, members: list[Member], *, sender_gpu: str | None, cuda: bool | None = None
) -> str:
    """How ``members`` take weights: ``backend`` (``weights.backend``), where ``auto`` is ``ipc``
    (no group: a handle to each bucket, asyncrl.weights.ipc) for generators on rank 0's own GPU
    ``sender_gpu`` (as their ``/server_info`` reports: NCCL refuses a second rank on one device,
    and gloo goes through host memory), gloo as soon as one member cannot join NCCL (a built-in
    engine on CPU), else NCCL on a CUDA machine (:func:`rendezvous.default_backend`). ``cuda``:
    whether CUDA is available (None: ask torch)."""
    if backend != "auto":
        return backend
    if members and all(m.on_gpu(sender_gpu) for m in members):
        return "ipc"
    gloo_member = any(m.needs_gloo(sender_gpu) for m in members)
    return rendezvous.default_backend(gloo_member=gloo_member, cuda=cuda)


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


@dataclass
class Group:
    """One generator's weight group: learner rank 0 and that generator's ranks."""

    pg: dist.ProcessGroup
    spec: GroupSpec


class Groups:
    """Rank 0's weight groups by generator url (the sender task's).

    ``background``: the nursery that tears down abandoned groups (set by the sender task before
    any build). ``on_event(name, **fields)``: the broadcaster's progress callback."""

    def __init__(
        self,
        cfg: WeightsConfig,
        members: Members,
        fanout: FanOut,
        *,
        sender_gpu: str | None,
        on_event: Callable[..., None],
    ):
        self.cfg = cfg
        self.members = members
        self.fanout = fanout
        self.sender_gpu = sender_gpu
        self.on_event = on_event
        self.background: trio.Nursery | None = None
        self.built = 0  # groups built so far
        self._groups: dict[str, Group] = {}
        self._handles: set[str] = set()  # members that take buckets by handle: no group
        self._builds = 0
        # A live generator in a failed collective (a broadcast, a group's rendezvous) answers only
        # once its own group timed out (timeout_s) and then as any call: it must not be taken for a
        # dead one before that.
        self.survivor_s = 2 * cfg.timeout_s + 5
        # Group names unique to this broadcaster: a generator may still hold the group of a learner
        # that was killed (it cannot be told to destroy it), and an init under that name fails.
        self._nonce = f"{os.getpid():x}{int(time.time()) % 65536:04x}"

    def urls(self) -> list[str]:
        return list(self._groups)

    def __getitem__(self, url: str) -> Group:
        return self._groups[url]

    def by_handle(self, url: str) -> bool:
        """Whether ``url`` takes each bucket as a handle to rank 0's memory (``ipc``: no group)."""
        return url in self._handles

    def backend(self, url: str) -> str | None:
        """How ``url`` takes weights now: ``ipc``, its group's backend, or None (neither yet)."""
        if url in self._handles:
            return "ipc"
        g = self._groups.get(url)
        return g.spec.backend if g is not None else None

    async def build(self, members: list[Member]) -> None:
        """Give every member without a weight group its own, and leave the groups of those no
        longer here: every new server's init posted concurrently while rank 0 joins all of their
        groups at once (the server calls return only once rank 0 has joined), so a server that
        never comes fails its own group alone. One port for all the groups of a build: rank 0's
        TCPStore is multi-tenant and each group's keys are under its own name. Without
        ``weights.master_port`` that store is bound to port 0 before the servers are told its port
        (:func:`rendezvous.host_store`)."""
        await self.drop([u for u in self._groups if u not in {m.url for m in members}])
        new = [m for m in members if m.url not in self._groups and m.url not in self._handles]
        if not new:
            return
        await self._ask_ranks(new)
        new = self._take_handles(new)
        if not new:
            return
        self._builds += 1
        host = self.cfg.master_addr
        store = None  # held until rank 0 has joined: the groups' own stores keep it alive then
        if self.cfg.master_port:
            port = self.cfg.master_port + (self._builds - 1) % 16
        else:
            store = await trio.to_thread.run_sync(rendezvous.host_store, host, self.cfg.timeout_s)
            port = store.port
        layouts = {m.url: rendezvous.group_layout([m.ranks or 1]) for m in new}
        specs = {
            m.url: GroupSpec(
                master_address=host,
                master_port=port,
                world_size=layouts[m.url][1],
                group_name=f"{self.cfg.group_name}-{self._nonce}-{self._builds}-{i}",
                backend=backend_for(self.cfg.backend, [m], sender_gpu=self.sender_gpu),
                timeout_s=self.cfg.timeout_s,
            )
            for i, m in enumerate(new)
        }
        joined, _, bad = await self.fanout.beside(
            new,
            lambda m: m.client.init_group(specs[m.url], rank_offset=layouts[m.url][0][0]),
            functools.partial(_join_groups, specs),
            lambda _: self.survivor_s + 5,
        )
        del store
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
            self._groups[url] = Group(pg=pg, spec=spec)
            self.built += 1
            log.info(
                "weights: group %s built for %s: world %d on %s:%d",
                spec.group_name,
                url,
                spec.world_size,
                host,
                port,
            )
            self.on_event(
                "group_built",
                url=url,
                group=spec.group_name,
                world_size=spec.world_size,
                port=port,
            )
        if culprits:
            raise Failed(culprits, f"{len(culprits)} of {len(specs)} group builds failed")

    def _take_handles(self, members: list[Member]) -> list[Member]:
        """Note the members that take buckets by handle (they need no group; one rank each, on
        this host); the rest, which do. A handle member of several ranks is refused."""
        rest, why = [], {}
        for m in members:
            if backend_for(self.cfg.backend, [m], sender_gpu=self.sender_gpu) != "ipc":
                rest.append(m)
            elif (m.ranks or 1) > 1:
                m.refused = (
                    f"weights.backend ipc passes one handle per bucket to a one-rank generator; "
                    f"this one has {m.ranks} ranks: set weights.backend to gloo or nccl"
                )
                why[m.url] = f"refused: {m.refused}"
            else:
                self._handles.add(m.url)
                log.info("weights: %s takes buckets by handle (ipc, no group)", m.url)
        if why:
            raise Failed(why, "; ".join(f"{u}: {w}" for u, w in why.items()))
        return rest

    async def _ask_ranks(self, members: list[Member]) -> None:
        """Each new member's rank count from its ``/server_info`` (a TP-4 SGLang server takes 4): a
        worker cannot know it, and a wrong count hangs the group's rendezvous. Those refused
        (:func:`ask_server`) are dropped before any group or weights."""
        new = [m for m in members if m.ranks is None]
        ok, bad = await self.fanout.each(
            new,
            functools.partial(ask_server, pause_mode=self.cfg.pause_mode),
            self.cfg.timeout_s + 1,
        )
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
            raise Failed(why, "; ".join(f"{u}: {w}" for u, w in why.items()))

    async def drop(self, urls: list[str], *, background: bool = True, tell: bool = True) -> None:
        """Leave the groups of ``urls``: their servers destroy their side (best effort; not
        ``tell``: a server that just failed in its group, which would answer only once that group
        timed out), rank 0 destroys its own."""
        self._handles.difference_update(urls)  # asked again when it rejoins
        gone = {u: g for u in urls if (g := self._groups.pop(u, None)) is not None}
        if not gone:
            return
        members = self.members.these(list(gone)) if tell else []
        quick = min(5.0, self.cfg.timeout_s)
        await self.fanout.each(
            members,
            lambda m: m.client.destroy_group(gone[m.url].spec.group_name, timeout_s=quick),
            quick + 1,
        )
        for g in gone.values():
            if background:
                self._abandon(g.pg)
            else:
                await self.fanout.in_thread(rendezvous.destroy_process_group, g.pg)

    def _abandon(self, pg: dist.ProcessGroup) -> None:
        """Destroy a group whose peers may be gone. Gloo's shutdown waits for a stuck collective to
        time out, so it runs as a background task nobody waits for (group names are never reused),
        its thread left behind when the sender stops; an NCCL group is aborted first
        (rendezvous.abandon_process_group)."""
        assert self.background is not None
        abandon = functools.partial(
            trio.to_thread.run_sync, rendezvous.abandon_process_group, pg, abandon_on_cancel=True
        )
        self.background.start_soon(abandon, name="weights-abandon-group")


def _join_groups(specs: Mapping[str, GroupSpec]) -> dict[str, Any]:
    """Rank 0's rendezvous in every group of ``specs`` at once, a thread each (each waits for its
    server's ranks, up to ``timeout_s``): the new group, or the exception, by url."""

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
