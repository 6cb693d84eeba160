"""The sender's state machine: at most one version in flight, holds, and newest-only pending.

A task of rank 0's control plane (asyncrl.control) runs what the training thread hands over, one
at a time. A version handed over while one is in flight waits for it to be out. A hold (the
``after`` hook after each version, or a blocking function handed over on its own: the held-out
evaluation) keeps the generators on the version they have while it runs in a worker thread; a
version handed over meanwhile does not wait: it becomes the pending one, which goes out when the
hold ends, and a newer one replaces it (the replaced one counted in ``skipped``).

Pure trio: what a version is (its snapshot, its sync) is the job's business.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from asyncrl.weights.threads import lower_priority

log = logging.getLogger("asyncrl.weights")

Job = Callable[[], Awaitable[Any]]
"""One version's send; what it returns goes to the ``after`` hook."""
Hold = Callable[[], None]
"""Blocking work (the held-out evaluation) during which the generators hold the version they have."""


class Sender:
    """The sender task's state; touched only in the control plane's loop.

    ``after(result)``: a hold after each version (None: none). ``nice``: holds run at a lower CPU
    priority (the transfer overlaps the learner's step)."""

    def __init__(self, after: Callable[[Any], None] | None = None, *, nice: bool = False):
        self.after = after
        self.nice = nice
        self.skipped = 0  # versions replaced by a newer one while the generators were held
        self.last_version = 0  # the newest version handed over
        self._holding = False
        self._pending: Job | None = None
        self._running = False  # a version (or a hold) is in flight
        self._idle = trio.Event()  # set when nothing is in flight; replaced per run
        self._sent = trio.Event()  # set when the version in flight is out; replaced per version
        self._idle.set()
        self._sent.set()
        self._work: trio.MemorySendChannel[tuple[Job | None, Hold | None]] | None = None

    @property
    def running(self) -> bool:
        """A version (or a hold) is in flight."""
        return self._running

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run each version (and hold) handed over, one at a time, until :meth:`close`."""
        send, recv = trio.open_memory_channel[tuple[Job | None, Hold | None]](1)
        async with recv:
            self._work = send
            task_status.started()
            async for job, hold in recv:
                await self._run(job, hold)

    def close(self) -> None:
        """End :meth:`serve` once it has run what it was handed."""
        if self._work is not None:
            self._work.close()

    async def hand_over(self, version: int, job: Job) -> None:
        """Once the previous version is out: keep ``job`` as the pending one while the generators
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

    async def hold(self, fn: Hold) -> None:
        """Once nothing is in flight, hold the generators while ``fn`` runs."""
        await self._idle.wait()
        self._start(None, fn)
        self._holding = True  # after the start: a stopped sender holds nothing

    async def wait_idle(self, timeout: float) -> bool:
        """Nothing in flight (False: still something after ``timeout`` seconds)."""
        with trio.move_on_after(timeout):
            await self._idle.wait()
            return True
        return False

    def _start(self, job: Job | None, hold: Hold | None) -> None:
        assert self._work is not None and self._idle.is_set()
        # sent first: to a stopped sender it raises, and nothing may then wait for this run's end
        self._work.send_nowait((job, hold))
        self._running = True
        self._idle = trio.Event()
        if job is not None:
            self._sent = trio.Event()

    def _niced(self, fn: Hold) -> None:
        if self.nice:
            lower_priority()
        fn()

    async def _run(self, job: Job | None, hold: Hold | None) -> None:
        """Send a version; hold the generators on it while ``after`` runs (a hand-over meanwhile
        keeps the newest version as pending); send the pending one; again."""
        try:
            while True:
                if job is not None:
                    result = await job()
                    job = None
                    if self.after is not None:
                        self._holding = True
                        hold = functools.partial(self.after, result)
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
        finally:  # even on an error: a hand-over must never wait for a sender that has stopped
            self._holding = False
            self._running = False
            self._sent.set()
            self._idle.set()
