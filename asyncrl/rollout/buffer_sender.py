"""Sending: puts finished groups to the buffer (``wire.Put``, several per message), resending the SAME
group ids until each is acknowledged or rejected; with the buffer's dedup by id, exactly once."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from asyncrl import wire
from asyncrl.buffer.client import BufferClient, BufferRefused
from asyncrl.progress import Throttle
from asyncrl.rollout.prompts import PromptSource
from asyncrl.transport import TransportTimeout

if TYPE_CHECKING:
    from asyncrl.rollout.worker_stats import WorkerStats

log = logging.getLogger("asyncrl.rollout.worker")  # one logger for the worker's parts


class Sender:
    """Takes groups (:meth:`submit`) and delivers them (:meth:`run`). ``settled`` is called for each
    group the buffer acknowledged or rejected, ``saw_version`` with the version of every reply."""

    def __init__(
        self,
        *,
        buffer: BufferClient,
        source: PromptSource,
        stats: WorkerStats,
        worker_id: str,
        put_batch: int,
        acked_log: str,
        quiet: Throttle,
        retry_sleep: Callable[[int], Awaitable[None]],
        settled: Callable[[wire.Group], None],
        saw_version: Callable[[int], None],
    ) -> None:
        self.buffer = buffer
        self.source = source
        self.stats = stats
        self.worker_id = worker_id
        self.put_batch = put_batch  # groups per Put message (1 after a refusal: find the bad one)
        self.acked_log = acked_log
        self._quiet = quiet
        self._retry_sleep = retry_sleep
        self._settled = settled
        self._saw_version = saw_version
        self._send, self._receive = trio.open_memory_channel[wire.Group](float("inf"))
        self.pending: dict[str, wire.Group] = {}  # sent, not yet acknowledged

    def submit(self, group: wire.Group) -> None:
        self._send.send_nowait(group)

    async def run(self) -> None:
        """Put finished groups; resend the same ids until each is acked or rejected."""
        pending = self.pending
        attempt = 0
        while True:
            if not pending:
                g = await self._receive.receive()
                pending[g.id] = g
            while len(pending) < self.put_batch:  # take whatever else is ready
                try:
                    g = self._receive.receive_nowait()
                except trio.WouldBlock:
                    break
                pending[g.id] = g
            groups = list(pending.values())[: self.put_batch]
            counters = self.stats.counters
            state = self.source.state_dict()
            state["seq"] = counters["put_messages"]  # later snapshots win
            sent = {g.prompt_index for g in groups}
            state["outstanding"] = [i for i in state["outstanding"] if i not in sent]
            for g in groups:  # the data position as if these were delivered (see prompts.py)
                g.data_state = state
            try:
                counters["put_messages"] += 1
                if attempt:
                    counters["put_resends"] += 1
                ack = await self.buffer.put(groups, attempts=1)  # resending is ours, below
            except TransportTimeout as e:
                self._quiet.warning("put", "put of %d group(s): %s; resending", len(groups), e)
                await self._retry_sleep(min(attempt, 3))
                attempt += 1
                continue
            except BufferRefused as e:
                if len(groups) > 1:  # find the one the buffer cannot read: send them one by one
                    log.warning("put refused (%s); resending one group per message", e)
                    self.put_batch = 1
                    continue
                log.error("group %s refused by the buffer: %s; dropped", groups[0].id, e)
                ack = wire.Ack(group_ids=[], rejected={groups[0].id: str(e)})
            attempt = 0
            self._quiet.ok("put")
            self._saw_version(ack.version)
            self._log_acked([gid for gid in ack.group_ids if gid in pending])
            for gid in ack.group_ids:
                if gid in pending:
                    g = pending.pop(gid)
                    self.source.done(g.prompt_index)
                    counters["groups_delivered"] += 1
                    self._settled(g)
            for gid, why in ack.rejected.items():
                if gid in pending:
                    g = pending.pop(gid)
                    self.source.done(g.prompt_index)
                    counters["groups_rejected"] += 1
                    log.warning("group %s rejected: %s", gid, why)
                    self._settled(g)

    def _log_acked(self, ids: list[str]) -> None:
        """One line per Ack: what the buffer now owns (an audit compares it with what was trained)."""
        if not (ids and self.acked_log):
            return
        line = json.dumps({"worker_id": self.worker_id, "acked": ids, "t": time.time()})
        try:
            with open(self.acked_log, "a") as f:
                f.write(line + "\n")
        except OSError as e:  # the audit must never stop rollouts
            log.warning("acked log %s: %s", self.acked_log, e)
