"""The recording client as an OpenAI-compatible HTTP endpoint, one per episode (AReaL's proxy mode):
an agent in another process or language, or the OpenAI Agents SDK, points its client's ``base_url``
at it and is trained as an in-process agent is (docs/design.md §6, "Agents on the OpenAI API").

Each episode gets its own loopback server on a free port, for as long as the episode runs: no routing
between episodes, and nothing left listening once it ends. ``POST /v1/chat/completions`` (not
streamed) and ``GET /v1/models``; errors in OpenAI's error shape (a mismatched trajectory is a 400).
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import h11
import trio

from asyncrl.agents.recording import RecordingClient
from asyncrl.contract import Episode, EpisodeContext

MAX_BODY = 64 << 20
log = logging.getLogger("asyncrl.rollout.worker")


@dataclass(frozen=True)
class Endpoint:
    """Where an episode's agent sends its requests (``openai.OpenAI(base_url=, api_key=)``)."""

    base_url: str
    api_key: str


def _error(status: int, message: str, type_: str = "BadRequestError") -> tuple[int, dict]:
    return status, {"error": {"object": "error", "message": message, "type": type_, "code": status}}


async def _route(
    client: RecordingClient, key: str, method: str, path: str, auth: str, body: bytes
) -> tuple[int, dict]:
    if auth != f"Bearer {key}":
        return _error(401, "unknown API key for this episode", "AuthenticationError")
    if method == "GET" and path == "/v1/models":
        return 200, {"object": "list", "data": [{"id": "asyncrl", "object": "model"}]}
    if method != "POST" or path != "/v1/chat/completions":
        return _error(404, f"{method} {path} is not served here", "NotFoundError")
    try:
        req = json.loads(body)
        if not isinstance(req, dict):
            raise ValueError("the body must be a JSON object")
        r = await client.create(**req)
    except (TypeError, ValueError) as e:  # includes TrajectoryMismatch and bad JSON
        return _error(400, f"{type(e).__name__}: {e}")
    except Exception as e:  # the generators failed: the agent sees a 500, as from a server
        log.warning(
            "episode %s: a proxied call failed: %s: %s", client.ctx.rid, type(e).__name__, e
        )
        return _error(500, f"{type(e).__name__}: {e}", "InternalServerError")
    return 200, r.model_dump(exclude_unset=True)


async def _connection(stream: trio.SocketStream, handle: Callable[..., Awaitable]) -> None:
    """HTTP/1.1 with keep-alive, one request at a time (one conversation)."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=1 << 16)
    try:
        while True:
            req, body = None, bytearray()
            while True:
                ev = conn.next_event()
                if ev is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(1 << 16))
                elif isinstance(ev, h11.Request):
                    req = ev
                elif isinstance(ev, h11.Data):
                    body += ev.data
                    if len(body) > MAX_BODY:
                        return
                elif isinstance(ev, h11.EndOfMessage):
                    break
                elif isinstance(ev, h11.ConnectionClosed):
                    return
            assert req is not None
            headers = {k.decode().lower(): v.decode() for k, v in req.headers}
            status, payload = await handle(
                req.method.decode(),
                req.target.decode().split("?")[0],
                headers.get("authorization", ""),
                bytes(body),
            )
            data = json.dumps(payload).encode()
            head = h11.Response(
                status_code=status,
                headers=[("content-type", "application/json"), ("content-length", str(len(data)))],
            )
            await stream.send_all(conn.send(head) + conn.send(h11.Data(data=data)))
            await stream.send_all(conn.send(h11.EndOfMessage()))
            if conn.our_state is h11.MUST_CLOSE:
                return
            conn.start_next_cycle()
    except (h11.RemoteProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
        return
    finally:
        await trio.aclose_forcefully(stream)


@asynccontextmanager
async def serve_episode(client: RecordingClient) -> AsyncIterator[Endpoint]:
    """A loopback endpoint recording into ``client`` while the block runs."""
    key = secrets.token_hex(16)

    async def handle(method: str, path: str, auth: str, body: bytes) -> tuple[int, dict]:
        return await _route(client, key, method, path, auth, body)

    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listener.socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, lambda s: _connection(s, handle), [listener])
        try:
            yield Endpoint(f"http://127.0.0.1:{port}/v1", key)
        finally:
            nursery.cancel_scope.cancel()


ProxyAgent = Callable[[Endpoint, dict[str, Any]], Awaitable[Any]]


class ProxyAgentWorkflow:
    """An agent that talks HTTP: ``async def agent(endpoint, row)`` hands ``endpoint.base_url`` and
    ``endpoint.api_key`` to whatever runs the conversation (a subprocess, the Agents SDK) and
    returns its reward or None, as :class:`~asyncrl.agents.recording.AgentWorkflow`."""

    def __init__(self, agent: ProxyAgent, *, template_kwargs: dict[str, Any] | None = None):
        self.agent = agent
        self.template_kwargs = template_kwargs

    async def run_episode(self, ctx: EpisodeContext) -> Episode:
        from asyncrl.agents.recording import checked_reward

        client = RecordingClient(ctx, template_kwargs=self.template_kwargs)
        async with serve_episode(client) as endpoint:
            out = await self.agent(endpoint, ctx.row)
        return client.episode(checked_reward(out))
