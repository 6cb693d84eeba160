"""Whether the learner and a worker's generators can reach each other (docs/multinode.md).

The learner's weight broadcaster calls every registered generator by the URL its worker gave. A
built-in engine that listens on loopback while the learner is on another host is alive and serves
its worker, but the learner can never reach it: it never gets weights, and once it is η versions
behind its worker takes no more leases. Two guards, both here:

- on the worker's side, :func:`engine_host`: where a built-in engine listens. Left empty
  (``generator.host``'s default), it is loopback for a learner on this host, else this host's
  address on the route to the learner's address (a UDP socket's ``connect``: the kernel picks the
  source address, no packet is sent). Loopback set by hand for a remote learner is refused.
- on the learner's side, :func:`unreachable`: a worker's first registration is refused when the
  learner cannot connect to one of its generators (asyncrl.buffer.service), so the worker stops
  at once with the cause, instead of a silent drop and a wait that never ends.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import httpx

from asyncrl.generator_http import GeneratorError, acall, async_client

LOOPBACK = "127.0.0.1"
"""Where a built-in engine listens when the learner is on the same host."""

REACH_TIMEOUT_S = 5.0
"""The learner's bound on connecting to a registering worker's generator."""

ANY_HOST = frozenset({"0.0.0.0", "::", "*", ""})
"""Listen addresses meaning every interface: a peer cannot dial them."""


class HostError(ValueError):
    """``generator.host`` cannot work with this learner address; the text names the key."""


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def learner_host(address: str) -> tuple[str, int] | None:
    """The host and port of a tcp (or tls+tcp) nng address; None for one on this host only (ipc,
    inproc) or a wildcard."""
    parts = urlsplit(address)
    if not parts.scheme.endswith("tcp") or parts.hostname in ANY_HOST or parts.hostname is None:
        return None
    return parts.hostname, parts.port or 0


def route_address(host: str, port: int) -> str:
    """This host's address on the route to ``host``: the source address the kernel picks for a
    UDP socket connected there (a connect sends nothing). Raises OSError (no name, no route)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port or 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as s:
        s.connect(addr)
        return str(s.getsockname()[0])


def engine_host(configured: str, learner_address: str) -> str:
    """Where this worker's built-in engines listen, for a learner at ``learner_address``.

    ``configured`` is ``generator.host`` ("": derive it). A learner on this host (loopback, ipc,
    a name that routes over loopback) keeps loopback; a remote one gets the address on the route to
    it, since the learner must call the engines. Raises :class:`HostError` for loopback set by hand
    with a remote learner, or a remote learner with no route to it."""
    where = learner_host(learner_address)
    if where is None:
        return configured or LOOPBACK
    try:
        own = route_address(*where)
    except OSError as e:
        if configured and not is_loopback(configured):
            return configured
        raise HostError(
            f"generator.host: no route to the learner's host {where[0]} ({e}) to find this "
            "host's address there; set generator.host to an address of this host the learner "
            "can reach"
        ) from None
    if is_loopback(own):  # the learner is on this host
        return configured or LOOPBACK
    if not configured:
        return own
    if is_loopback(configured):
        raise HostError(
            f"generator.host: {configured} is loopback, but the learner ({learner_address}) is "
            f"on another host and could not reach this worker's engines; leave generator.host "
            f"empty (this host's address on the route to the learner: {own}) or set an address "
            "of this host the learner can reach"
        )
    return configured


def dial_host(listen: str, learner_address: str) -> str:
    """The host the learner dials for an engine listening on ``listen``: a wildcard (0.0.0.0) is
    not an address, so this host's address on the route to the learner (loopback if local)."""
    if listen not in ANY_HOST:
        return listen
    return engine_host("", learner_address)


async def unreachable(url: str, *, timeout_s: float = REACH_TIMEOUT_S) -> str | None:
    """Why this process cannot reach the HTTP server at ``url``; None if it can.

    Any answer counts, whatever its status (a server still loading answers 503), and so does a
    connection whose answer is slow: only a failure to connect is a matter of the network (refused,
    no route, no such name, no answer to the connect within ``timeout_s``)."""
    async with async_client(timeout_s) as http:
        try:
            await acall(http, url.rstrip("/"), "GET", "/health")
        except GeneratorError as e:
            cause = e.__cause__
            if not e.dead or isinstance(cause, httpx.ReadTimeout | httpx.WriteTimeout):
                return None
            if isinstance(cause, httpx.ConnectTimeout):
                return f"no answer to a connect within {timeout_s:g} s"
            return f"{type(cause).__name__}: {cause}" if cause is not None else e.message
    return None
