"""Calls to every generator at once, beside rank 0's collective.

A generator's HTTP call for a group's rendezvous or a bucket returns only once rank 0's side of
that collective is done, so both run at once: a task per generator for its call (async, on the
sender's loop), the collective in a worker thread (blocking torch.distributed; on the sender's CUDA
stream while a version from the GPU is in flight), every wait bounded. Who has not answered in time
failed; nothing here waits on a dead peer.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import torch
import trio

from asyncrl.generator_http import GeneratorError
from asyncrl.weights.members import Member
from asyncrl.weights.threads import lower_priority

T = TypeVar("T")


class Failed(Exception):
    """Some generators failed during an attempt: ``culprits`` are dropped, the rest retry."""

    def __init__(self, culprits: dict[str, str], message: str):
        self.culprits = culprits
        super().__init__(message)


class FanOut:
    """The sender's HTTP calls (a task each, many at once) and its worker thread for collectives
    (one at a time).

    ``nice``: the collectives' threads run at a lower CPU priority (the transfer overlaps the
    learner's step).
    ``ready``: the version in flight's CUDA event (None: from the CPU), which the sender's stream
    waits on before a collective reads the snapshot."""

    def __init__(self, *, nice: bool):
        self.nice = nice
        self.ready: Any = None
        self._stream: Any = None  # the sender's CUDA stream, made on first use (GPU only)
        self._collective_limiter = trio.CapacityLimiter(1)  # one broadcast or rendezvous at a time

    async def drain(self) -> None:
        """Wait for what the sender's stream queued (before the snapshot it reads is released: the
        allocator could hand its memory to the training stream while a broadcast still reads it)."""
        if self.ready is not None and self._stream is not None:
            await trio.to_thread.run_sync(self._stream.synchronize)

    def _niced(self, fn: Callable[..., T], *args: Any) -> T:
        if self.nice:
            lower_priority()
        return fn(*args)

    def _on_stream(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn`` on the sender's CUDA stream after the training thread's gather while a version
        from the GPU is in flight: on the default stream the training step's kernels would queue
        behind the broadcast. On CPU: just ``fn``."""
        if self.ready is None:
            return self._niced(fn, *args)
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(self.ready)
            return self._niced(fn, *args)

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """A snapshot, a rendezvous, a broadcast or the checksum of what was sent: one at a time,
        each bounded by its own timeout (the checksum by its size)."""
        return await trio.to_thread.run_sync(
            functools.partial(self._on_stream, fn, *args), limiter=self._collective_limiter
        )

    async def each(
        self, members: list[Member], fn: Callable[[Member], Awaitable[Any]], timeout: float
    ) -> tuple[dict[str, Any], dict[str, GeneratorError | Exception]]:
        """Run ``fn`` for every member concurrently; results and failures by url (bounded wait)."""
        _, ok, bad = await self.beside(members, fn, None, lambda _: timeout)
        return ok, bad

    async def beside(
        self,
        members: list[Member],
        fn: Callable[[Member], Awaitable[Any]],
        collective: Callable[[], Any] | None,
        bound: Callable[[Any], float],
        failed: Callable[[Any], Iterable[str]] = lambda _: (),
    ) -> tuple[Any, dict[str, Any], dict[str, GeneratorError | Exception]]:
        """Run ``fn`` for every member concurrently (a task each; its HTTP client's timeout bounds
        each call) while rank 0's ``collective`` runs in a worker thread (the servers' calls return
        only once it is done); then give them ``bound(its result)`` more seconds, and cancel who
        is still waiting. Returns the collective's result (or its exception), and the members'
        results and failures by url: who has not answered failed.

        ``failed(its result)``: the members the collective already failed for. Their calls are
        cancelled at once, not waited for: a member cut off in the middle of a broadcast would
        otherwise cost the bound a second time (measured: a generator partitioned during a weight
        broadcast was dropped after 2 x ``weights.timeout_s``, tests/faults/test_network_faults.py)."""
        ok: dict[str, Any] = {}
        bad: dict[str, GeneratorError | Exception] = {}
        scopes = {m.url: trio.CancelScope() for m in members}

        async def one(m: Member) -> None:
            with scopes[m.url]:
                try:
                    ok[m.url] = await fn(m)
                except Exception as e:
                    bad[m.url] = e

        result: Any = None
        async with trio.open_nursery() as nursery:
            for m in members:
                nursery.start_soon(one, m, name=f"weights-http {m.url}")
            if collective is not None:
                try:
                    result = await self.in_thread(collective)
                except Exception as e:
                    result = e
            wait_s = bound(result)
            nursery.cancel_scope.deadline = trio.current_time() + wait_s
            for url in failed(result):
                if url in scopes:
                    scopes[url].cancel()
        for m in members:
            if m.url not in ok and m.url not in bad:
                bad[m.url] = GeneratorError(f"no answer within {wait_s:g}s", url=m.url, dead=True)
        return result, ok, bad
