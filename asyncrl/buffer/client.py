"""A small trio client of the buffer service, for workers, tools and tests.

Each call is one Req/Rep exchange bounded by a timeout. :meth:`BufferClient.put` resends the same
groups (same ids) after a timeout: the buffer deduplicates by id, so a group is stored once however
often it is sent. An Error reply raises :class:`BufferRefused`; it is never retried.

:func:`buffer_status` is one blocking Status request, for code without a loop: `asyncrl run`'s
progress display, a worker asking the learner's version before it starts its engines.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

from asyncrl import backoff, wire
from asyncrl.transport import TLS, ReqClient, TransportTimeout

if TYPE_CHECKING:
    from asyncrl.recipe import Recipe

__all__ = ["BufferClient", "BufferRefused", "buffer_status"]


class BufferRefused(RuntimeError):
    """The buffer answered with ``wire.Error`` (``code`` says which kind of refusal)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


REQUEST_TIMEOUT_S = 10.0
"""A worker's wait for the buffer's reply before it says "no reply" and resends."""


class BufferClient:
    def __init__(
        self,
        address: str,
        *,
        worker_id: str,
        tls: TLS | None = None,
        timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self.worker_id = worker_id
        self.timeout_s = timeout_s
        self._req = ReqClient(address, tls=tls, timeout_s=timeout_s)

    async def _call(
        self, msg: wire.Message, expect: type, timeout_s: float | None = None
    ) -> wire.Message:
        reply = await self._req.request(msg, timeout_s=timeout_s)
        if isinstance(reply, wire.Error):
            raise BufferRefused(reply.code, reply.message)
        if not isinstance(reply, expect):
            raise BufferRefused("unexpected_reply", f"expected {expect.kind}, got {reply.kind}")
        return reply

    async def acquire(self, n: int, *, request_id: str = "") -> wire.Grant:
        """Ask for up to ``n`` starts; a grant of 0 starts means: at the bound, ask again later."""
        msg = wire.Acquire(worker_id=self.worker_id, starts=n, request_id=request_id)
        return await self._call(msg, wire.Grant)

    async def put(
        self,
        groups: list[wire.Group],
        *,
        attempts: int = 5,
        timeout_s: float | None = None,
        backoff_s: float = 0.1,
    ) -> wire.Ack:
        """Deliver groups; resend on timeout (same ids) up to ``attempts`` times in all."""
        msg = wire.Put(worker_id=self.worker_id, groups=groups)
        for attempt in range(attempts):
            try:
                return await self._call(msg, wire.Ack, timeout_s)
            except TransportTimeout:
                if attempt == attempts - 1:
                    raise
                await trio.sleep(backoff.delay_s(attempt, first=backoff_s, cap=2.0))
        raise AssertionError("unreachable")  # pragma: no cover

    async def release(self, lease_id: str, n: int) -> wire.Ok:
        msg = wire.Release(worker_id=self.worker_id, lease_id=lease_id, starts=n)
        return await self._call(msg, wire.Ok)

    async def register(
        self, generators: list[wire.GeneratorInfo], *, fresh: bool = False
    ) -> wire.Ok:
        msg = wire.Register(worker_id=self.worker_id, generators=generators, fresh=fresh)
        return await self._call(msg, wire.Ok)

    async def status(self) -> wire.StatusReply:
        return await self._call(wire.Status(), wire.StatusReply)

    def close(self) -> None:
        self._req.close()

    async def __aenter__(self) -> BufferClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


def buffer_status(address: str, r: Recipe, timeout_s: float = 2.0) -> dict[str, Any] | None:
    """The buffer's Status reply as a dict (version + stats), or None if it does not answer."""
    tls = TLS.from_config(r) if r.buffer.tls.cert else None
    try:
        with ReqClient(address, tls=tls, timeout_s=timeout_s) as client:
            reply = client.request_sync(wire.Status(), timeout_s=timeout_s)
    except Exception:  # a timeout, a bad reply, pynng errors while the learner starts or stops
        return None
    if isinstance(reply, wire.StatusReply):
        return {"version": reply.version, **reply.stats}
    return None
