"""The broadcaster's view of the generators: who is registered, and in which state.

Any thread registers and removes generators (the buffer service's callback, the learner); the
sender task moves them between states. Everything here is under one lock and does no I/O: the
calls to generators are the sender's (asyncrl.weights.sync).

States: ``joining`` (registered, or back after a drop: joins with a new group at the next version),
``member`` (confirmed a version), ``dropped`` (failed or refused: probed before each version),
``removed`` (unregistered: nothing more is sent).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from asyncrl.generator_http import WeightsClient
from asyncrl.gpu import needs_gloo, same_gpu
from asyncrl.wire import GeneratorInfo

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
    refused: str = ""  # why its settings cannot take the updates (groups.Refused): kept out
    device: str | None = None  # its /server_info's ``device`` (None: not said), asked with ranks
    gpu_uuid: str | None = None  # its /server_info's ``gpu_uuid``: the GPU it runs on, if said

    @property
    def url(self) -> str:
        return self.client.url

    def on_gpu(self, sender_gpu: str | None) -> bool:
        """It runs on rank 0's own GPU ``sender_gpu`` (its ``/server_info`` ``gpu_uuid``), where
        it takes weights by CUDA IPC handle (:func:`asyncrl.gpu.same_gpu`)."""
        return same_gpu(self.gpu_uuid, sender_gpu)

    def needs_gloo(self, sender_gpu: str | None) -> bool:
        """It cannot join an NCCL group with rank 0 on ``sender_gpu``: it receives on CPU, or
        runs on that very GPU (:func:`asyncrl.gpu.needs_gloo`)."""
        return needs_gloo(self.info.kind, self.device, self.gpu_uuid, sender_gpu=sender_gpu)


class Members:
    """The registered generators by url, under a lock (callers' threads vs the sender task).

    ``client(info)``: a new member's HTTP client."""

    def __init__(self, client: Callable[[GeneratorInfo], WeightsClient]):
        self._client = client
        self._members: dict[str, Member] = {}
        self._by_worker: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def add(self, info: GeneratorInfo) -> bool:
        """Register a generator (it joins at the next version); False: it was registered already
        (its info is updated)."""
        url = info.url.rstrip("/")
        with self._lock:
            m = self._members.get(url)
            if m is not None and m.state != "removed":
                m.info = info
                return False
            self._members[url] = Member(info=info, client=self._client(info), state="joining")
        return True

    def remove(self, url: str) -> bool:
        """Send nothing more to ``url``; False: it was not registered."""
        url = url.rstrip("/")
        with self._lock:
            m = self._members.get(url)
            if m is None or m.state == "removed":
                return False
            m.state = "removed"
        return True

    def replace(self, worker_id: str, urls: set[str]) -> set[str]:
        """A worker's current generator urls, which replace its last ones: those gone from them."""
        with self._lock:
            gone = self._by_worker.get(worker_id, set()) - urls
            self._by_worker[worker_id] = urls
        return gone

    def states(self) -> dict[str, State]:
        """url -> state, the removed ones left out."""
        with self._lock:
            return {u: m.state for u, m in self._members.items() if m.state != "removed"}

    def these(self, urls: list[str]) -> list[Member]:
        """The members of ``urls`` (those ever registered), in that order."""
        with self._lock:
            return [self._members[u] for u in urls if u in self._members]

    def known(self) -> list[Member]:
        """Every member not removed."""
        with self._lock:
            return [m for m in self._members.values() if m.state != "removed"]

    def active(self) -> list[Member]:
        """The members a version goes to (joining ones included)."""
        with self._lock:
            return [m for m in self._members.values() if m.state in ("joining", "member")]

    def all(self) -> list[Member]:
        with self._lock:
            return list(self._members.values())

    def drop(self, url: str, why: str) -> Member | None:
        """Mark ``url`` dropped for ``why``; the member, or None if it was dropped or removed
        already (or never registered)."""
        with self._lock:
            m = self._members.get(url)
            if m is None or m.state in ("dropped", "removed"):
                return None
            m.state, m.reason = "dropped", why
            return m

    def rejoin(self, m: Member) -> None:
        """``m`` is back: it joins with a new group at the next version."""
        with self._lock:
            m.state, m.reason = "joining", ""
