"""Learner rank 0's control plane: one trio loop, in one thread, beside the training loop.

The training loop is blocking torch code with collectives across ranks, so it keeps the main
thread. Everything else rank 0 serves (the buffer's nng service and version announcer, the weight
broadcaster's sender) runs as named tasks of the one nursery of :class:`ControlPlane`: HTTP calls
to generators are async tasks of the loop, blocking calls (gloo/NCCL collectives, the held-out
evaluation) go to worker threads through ``trio.to_thread`` with a limiter, every wait has a cancel
scope, and the training thread talks to the tasks through :meth:`ControlPlane.run`
(``trio.from_thread`` with the loop's token).

A task that raises ends the plane (structured concurrency: its siblings are cancelled) and the
error is kept in :attr:`ControlPlane.failure` for the training thread to report.

It is also how any other blocking code runs async code (``Evaluation.run`` for a process with no
loop): one way into trio from a thread, beside the rollout worker's own ``trio.run``.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

log = logging.getLogger("asyncrl.control")

T = TypeVar("T")


class ControlPlane:
    """One ``trio.run`` in a daemon thread with one nursery; start tasks in it, call into it."""

    def __init__(self, name: str = "control-plane", *, start_timeout_s: float = 30.0) -> None:
        self.name = name
        self.failure: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(ready,), name=name, daemon=True)
        self._thread.start()
        if not ready.wait(start_timeout_s) or self._nursery is None:
            raise RuntimeError(f"{name}: the trio loop did not start within {start_timeout_s:g} s")

    def _main(self, ready: threading.Event) -> None:
        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                ready.set()
                await trio.sleep_forever()

        try:
            trio.run(main)
        except BaseException as e:  # a task failed: kept for the training thread
            self.failure = e
            log.exception("%s stopped", self.name)
        finally:
            ready.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self, task: Callable[..., Awaitable[Any]], *args: Any, name: str) -> Any:
        """Start ``task(*args, task_status=...)`` in the nursery; returns once it called
        ``task_status.started(value)``, with that value."""
        assert self._nursery is not None
        return self.run(functools.partial(self._nursery.start, task, *args, name=name))

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run the async ``fn(*args)`` in the loop from another thread; its result (or error)."""
        if not self.alive:
            raise RuntimeError(f"{self.name} has stopped: {self.failure!r}")
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run the plain ``fn(*args)`` in the loop's thread (between its tasks' steps)."""
        if not self.alive:
            raise RuntimeError(f"{self.name} has stopped: {self.failure!r}")
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    def close(self, timeout_s: float = 10.0) -> None:
        """Cancel every task and wait for the loop to end (idempotent)."""
        if self.alive and self._nursery is not None:
            try:
                self.run_sync(self._nursery.cancel_scope.cancel)
            except (trio.RunFinishedError, RuntimeError):
                pass
        self._thread.join(timeout_s)
