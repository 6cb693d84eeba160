"""nng sockets for asyncrl's messages, under trio (docs/design.md §3).

Four roles, each a thin shell around one pynng socket and :mod:`asyncrl.wire`:

- :class:`RepServer` answers requests (the buffer service). Several requests are in flight at once
  (one nng context per worker task); a bad request gets a ``wire.Error`` reply and the server keeps
  serving; oversized requests are refused by nng before they are read (``recv_max_size``).
- :class:`ReqClient` sends a request and waits for the reply, with a timeout on every wait. It dials
  without blocking and nng reconnects by itself, so the server may start later or restart.
- :class:`Publisher` / :class:`Subscriber` announce versions; a subscriber skips bad messages.

Addresses are ``tcp://``, ``ipc://``, ``inproc://`` or ``tls+tcp://`` (mutual TLS, :class:`TLS`).
Port 0 is allowed for listeners: ``.address`` holds the real address after ``listen()``.
A small request's round trip under trio takes ~220 µs here, the same as raw pynng's (thread wake-ups,
not Python: measured in BENCHMARKS.md, wire); batch where throughput matters.

Timeouts: every Req/Rep wait takes its bound as an argument, at the line that waits, and nng itself
ends the operation when it passes. That is the one place asyncrl does not use a trio timeout scope
(the project's trio style): on the hot path a scope per request cost as much as the rest of the machinery (~7 µs
each side). An enclosing trio scope still cancels any wait.
"""

from __future__ import annotations

import inspect
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pynng
import trio
from pynng._aio import _aio_map  # pynng's completion registry: its C callback wakes our waiters too
from pynng._nng import ffi, lib  # nng itself: reused aios, messages read in place
from pynng.exceptions import check_err

from asyncrl import wire

__all__ = [
    "TLS",
    "Publisher",
    "RepServer",
    "ReqClient",
    "Subscriber",
    "TransportTimeout",
    "decode_message",
    "free_tcp_address",
]

Handler = Callable[[wire.Message], "wire.Message | Awaitable[wire.Message]"]

DEFAULT_TIMEOUT_S = 10.0
_RECONNECT_MIN_MS = 50
_RECONNECT_MAX_MS = 2000


class TransportTimeout(TimeoutError):
    """No reply: the wait timed out, or the connection dropped while the request was outstanding.

    Either way the request may or may not have been processed; whether to resend is the caller's
    decision (every asyncrl request is idempotent or carries an id for that reason).
    """


# --------------------------------------------------------------------------------------------------
# Addresses and TLS
# --------------------------------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (for peers that cannot bind port 0 and
    report it, such as a process-group rendezvous or a server started by command line)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_tcp_address(host: str = "127.0.0.1") -> str:
    """A ``tcp://host:port`` whose port was free a moment ago (prefer port 0 + ``.address``)."""
    return f"tcp://{host}:{free_port(host)}"


def _host(address: str) -> str:
    return urlsplit(address).hostname or ""


def _bound_address(address: str, listener: pynng.Listener) -> str:
    """Replace port 0 in a tcp address by the port nng actually bound."""
    if not address.startswith(("tcp://", "tls+tcp://")):
        return address
    parts = urlsplit(address)
    if parts.port not in (0, None):
        return address
    port = socket.ntohs(listener.local_address.port)
    host = parts.hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}:{port}"


@dataclass(frozen=True, kw_only=True)
class TLS:
    """Mutual TLS: this side's certificate and key, and the CA that signed the peers' (PEM files).

    The server requires a client certificate signed by ``ca``; the client verifies the server's
    certificate against ``ca`` and the name ``server_name`` (default: the host of the address it
    dials, so issue server certificates for the host or IP the clients dial).
    """

    cert: str
    key: str
    ca: str
    server_name: str = ""

    @classmethod
    def from_config(cls, cfg: Any) -> TLS | None:
        """From a recipe, its ``buffer`` section or ``buffer.tls``; None when TLS is not configured.

        Given the whole recipe, relative paths are resolved against the recipe file's folder.
        """
        resolve = getattr(cfg, "resolve", None)
        cfg = getattr(cfg, "buffer", cfg)
        cfg = getattr(cfg, "tls", cfg)
        if not (cfg.cert or cfg.key or cfg.ca):
            return None
        paths = [cfg.cert, cfg.key, cfg.ca]
        if resolve is not None:
            paths = [str(resolve(p)) for p in paths]
        return cls(cert=paths[0], key=paths[1], ca=paths[2])

    def _pem(self, field: str) -> str:
        path = getattr(self, field)
        try:
            return Path(path).read_text()
        except OSError as e:
            raise ValueError(f"tls.{field}: cannot read {path!r}: {e.strerror}") from None

    def server_config(self) -> pynng.TLSConfig:
        return pynng.TLSConfig(
            pynng.TLSConfig.MODE_SERVER,
            ca_string=self._pem("ca"),
            own_cert_string=self._pem("cert"),
            own_key_string=self._pem("key"),
            auth_mode=pynng.TLSConfig.AUTH_MODE_REQUIRED,
        )

    def client_config(self, address: str) -> pynng.TLSConfig:
        return pynng.TLSConfig(
            pynng.TLSConfig.MODE_CLIENT,
            server_name=self.server_name or _host(address),
            ca_string=self._pem("ca"),
            own_cert_string=self._pem("cert"),
            own_key_string=self._pem("key"),
            auth_mode=pynng.TLSConfig.AUTH_MODE_REQUIRED,
        )


def _check_tls(address: str, tls: TLS | None) -> TLS | None:
    """The TLS to use for ``address``: ipc:// and inproc:// never leave the machine and take none."""
    if address.startswith("tls+tcp://") and tls is None:
        raise ValueError(f"{address}: a tls+tcp:// address needs a TLS configuration")
    if tls is not None and address.startswith("tcp://"):
        raise ValueError(f"{address}: TLS is configured, so the address must be tls+tcp://")
    return tls if address.startswith("tls+tcp://") else None


def _dial(sock: pynng.Socket, address: str, tls: TLS | None) -> None:
    """Non-blocking dial: nng keeps retrying in the background, so the peer may start later."""
    tls = _check_tls(address, tls)
    if tls is not None:
        sock.tls_config = tls.client_config(address)
    sock.reconnect_time_min = _RECONNECT_MIN_MS
    sock.reconnect_time_max = _RECONNECT_MAX_MS
    sock.dial(address, block=False)


def _listen(sock: pynng.Socket, address: str, tls: TLS | None) -> str:
    tls = _check_tls(address, tls)
    if tls is not None:
        sock.tls_config = tls.server_config()
    return _bound_address(address, sock.listen(address))


# --------------------------------------------------------------------------------------------------
# Req/Rep
# --------------------------------------------------------------------------------------------------


_IN_PLACE_FROM = 64 * 1024  # bytes: a smaller message costs less to copy than to keep alive
_FOREVER = -1  # NNG_DURATION_INFINITE


def _ms(seconds: float) -> int:
    """An nng timeout: whole milliseconds, at least 1 (0 would mean "now or never")."""
    return max(1, int(min(seconds * 1000, 2**31 - 1)))  # inf: the longest nng can wait, ~25 days


class _Context:
    """One nng context and one aio reused for its every operation, awaited from trio.

    pynng's ``Context.asend``/``arecv`` allocate an aio and a callback record per operation
    (~6 µs), and a trio cancel scope per timeout costs ~7 µs more; here the aio lives as long as
    the context and nng enforces each operation's timeout itself (``pynng.Timeout``). Completions
    come through pynng's own C callback, which looks its waiter up in ``_aio_map`` by the id given
    to the aio. One operation at a time; trio cancellation cancels the nng operation.
    """

    def __init__(self, sock: pynng.Socket) -> None:
        ctx = ffi.new("nng_ctx *")
        check_err(lib.nng_ctx_open(ctx, sock.socket))
        self._ctx = ctx[0]
        aio = ffi.new("nng_aio **")
        check_err(lib.nng_aio_alloc(aio, lib._async_complete, ffi.cast("void *", id(self))))
        self._aio = aio[0]
        self._task: Any = None
        self._token: Any = None

    def _complete(self) -> None:  # on an nng thread, once per operation
        self._token.run_sync_soon(trio.lowlevel.reschedule, self._task)

    async def _run(self, start: Callable[[Any, Any], None], timeout_ms: int) -> None:
        aio = self._aio
        lib.nng_aio_set_timeout(aio, timeout_ms)
        self._task = trio.lowlevel.current_task()
        self._token = trio.lowlevel.current_trio_token()
        _aio_map[id(self)] = self._complete
        start(self._ctx, aio)
        raise_cancel = None

        def abort(raise_cancel_fn: Callable[[], None]) -> trio.lowlevel.Abort:
            nonlocal raise_cancel
            raise_cancel = raise_cancel_fn
            lib.nng_aio_cancel(aio)  # completes the operation soon, through _complete
            return trio.lowlevel.Abort.FAILED

        await trio.lowlevel.wait_task_rescheduled(abort)
        err = lib.nng_aio_result(aio)
        if err == lib.NNG_ECANCELED and raise_cancel is not None:
            raise_cancel()
        check_err(err)

    async def send(self, data: bytes, timeout_ms: int) -> None:
        msg = ffi.new("nng_msg **")
        check_err(lib.nng_msg_alloc(msg, 0))
        check_err(lib.nng_msg_append(msg[0], data, len(data)))
        lib.nng_aio_set_msg(self._aio, msg[0])
        try:
            await self._run(lib.nng_ctx_send, timeout_ms)
        except BaseException:
            lib.nng_aio_set_msg(self._aio, ffi.NULL)
            lib.nng_msg_free(msg[0])  # nng takes a message only when it sends it
            raise

    async def recv(self, timeout_ms: int) -> pynng.Message:
        await self._run(lib.nng_ctx_recv, timeout_ms)
        return pynng.Message(lib.nng_aio_get_msg(self._aio))

    def close(self) -> None:
        """Close the context, then free the aio (no operation may be in flight: each awaits its end).

        Owners call this; there is no ``__del__``: the garbage collector can run a finalizer on one of
        nng's own threads (pynng runs Python there), where freeing an aio deadlocks nng."""
        lib.nng_ctx_close(self._ctx)  # ECLOSED when the socket went first: nothing left to do
        lib.nng_aio_free(self._aio)
        _aio_map.pop(id(self), None)


def decode_message(m: pynng.Message, expect: type | tuple[type, ...] | None = None) -> wire.Message:
    """Decode a received nng message in place: its arrays are read-only views into nng's buffer,
    which a reference to ``m`` keeps alive for as long as any of them is (no copy of the body)."""
    n = lib.nng_msg_len(m._nng_msg)
    if n < _IN_PLACE_FROM:
        return wire.decode(m.bytes, expect=expect)
    body = ffi.gc(ffi.cast("char *", lib.nng_msg_body(m._nng_msg)), lambda _, keep=m: None)
    data = memoryview(ffi.buffer(body, n)).toreadonly()
    return wire.decode(data, expect=expect, in_place=True)


class RepServer:
    """Answers wire requests with ``handler(msg) -> reply`` (sync or async) until closed.

    ``stats`` counts ``received``, ``replied``, ``bad_messages`` (undecodable requests, answered with
    ``Error(code="bad_message")``) and ``handler_errors`` (the handler raised or returned something
    that is not a message; answered with ``Error(code="internal")``). Requests over
    ``max_message_bytes`` are dropped by nng before they are read; the sender sees a timeout.
    """

    def __init__(
        self,
        address: str,
        *,
        tls: TLS | None = None,
        max_message_bytes: int = wire.MAX_MESSAGE_BYTES,
        concurrency: int = 8,
        send_timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.address = address
        self._tls = tls
        self._concurrency = concurrency
        self._send_timeout_s = send_timeout_s
        self._sock = pynng.Rep0(recv_max_size=max_message_bytes)
        self._listening = False
        self._closed = False
        self.stats: dict[str, int] = {
            "received": 0,
            "replied": 0,
            "bad_messages": 0,
            "handler_errors": 0,
        }

    def listen(self) -> str:
        """Bind the address; returns (and stores in ``.address``) the real one, port 0 resolved."""
        if not self._listening:
            self.address = _listen(self._sock, self.address, self._tls)
            self._listening = True
        return self.address

    async def serve(self, handler: Handler) -> None:
        """Serve until :meth:`close` or cancellation; any bad input is answered, never fatal.

        Up to ``concurrency`` requests are handled at once. A sync handler runs on the event loop,
        so it must be quick (pure bookkeeping); slow work belongs in an async handler.
        """
        self.listen()
        async with trio.open_nursery() as nursery:
            for i in range(self._concurrency):
                nursery.start_soon(self._worker, handler, name=f"rep-worker-{i}")

    async def _worker(self, handler: Handler) -> None:
        ctx = _Context(self._sock)
        send_ms = _ms(self._send_timeout_s)
        try:
            while True:
                try:  # waiting for work is unbounded; close() ends it
                    request = await ctx.recv(_FOREVER)
                except pynng.Closed:
                    return
                self.stats["received"] += 1
                reply = await self._answer(handler, request)
                try:
                    await ctx.send(reply, send_ms)
                except pynng.Closed:
                    return
                except pynng.NNGException:  # a timeout too: the client went away
                    continue  # its request is its own to resend
                self.stats["replied"] += 1
        finally:
            ctx.close()

    async def _answer(self, handler: Handler, request: pynng.Message) -> bytes:
        try:
            msg = decode_message(request)
        except wire.WireError as e:
            self.stats["bad_messages"] += 1
            return wire.encode(wire.Error(code="bad_message", message=str(e)[:4096]))
        try:
            reply = handler(msg)
            if inspect.isawaitable(reply):
                reply = await reply
            return wire.encode(reply)
        except Exception as e:  # a handler bug must not stop the service
            self.stats["handler_errors"] += 1
            text = f"{type(e).__name__}: {e}"[:4096]
            return wire.encode(wire.Error(code="internal", message=text))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close()

    def __enter__(self) -> RepServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ReqClient:
    """Sends one request, waits for its reply; safe to use from several trio tasks at once.

    Each :meth:`request` uses its own nng context (kept for a later request once its exchange
    ends cleanly), so concurrent requests do not wait on each other.
    :meth:`request_sync` is for plain threads (e.g. the learner's training loop); it is serialised
    by a lock.
    """

    def __init__(
        self,
        address: str,
        *,
        tls: TLS | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_message_bytes: int = wire.MAX_MESSAGE_BYTES,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        # resend_time: nng would otherwise resend by itself after 60 s; resending is our decision.
        self._sock = pynng.Req0(recv_max_size=max_message_bytes, resend_time=-1)
        self._idle: list[_Context] = []  # contexts of finished requests, for the next ones
        self._lock = threading.Lock()
        self._closed = False
        _dial(self._sock, address, tls)

    async def request(
        self,
        msg: wire.Message,
        *,
        timeout_s: float | None = None,
        expect: type | tuple[type, ...] | None = None,
    ) -> wire.Message:
        """Send ``msg`` and return the decoded reply (a ``wire.Error`` reply is returned, not raised).

        Raises :class:`TransportTimeout` if the whole exchange takes over ``timeout_s``, and
        ``wire.WireError`` if the reply cannot be decoded (or is not of the ``expect`` kind).
        """
        data = wire.encode(msg)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        ctx = self._idle.pop() if self._idle else _Context(self._sock)
        done = False
        try:
            await ctx.send(data, _ms(timeout))
            reply = await ctx.recv(_ms(deadline - time.monotonic()))
            done = True
        except pynng.Timeout:
            raise TransportTimeout(
                f"no reply to {type(msg).kind} from {self.address} within {timeout:g} s"
            ) from None
        except pynng.Closed:
            raise
        except pynng.NNGException as e:  # e.g. the server restarted with our request outstanding
            raise TransportTimeout(
                f"no reply to {type(msg).kind} from {self.address}: {e}"
            ) from None
        finally:  # a context whose request failed may still hold it: only a clean one is reused
            if done and not self._closed:
                self._idle.append(ctx)
            else:
                ctx.close()
        return decode_message(reply, expect)

    def request_sync(
        self,
        msg: wire.Message,
        *,
        timeout_s: float | None = None,
        expect: type | tuple[type, ...] | None = None,
    ) -> wire.Message:
        """Blocking :meth:`request` for code that is not under trio."""
        data = wire.encode(msg)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        ms = _ms(timeout)
        with self._lock:
            self._sock.send_timeout = ms
            self._sock.recv_timeout = ms
            try:
                self._sock.send(data)
                reply = self._sock.recv_msg()
            except pynng.Timeout:
                raise TransportTimeout(
                    f"no reply to {type(msg).kind} from {self.address} within {timeout:g} s"
                ) from None
            except pynng.Closed:
                raise
            except pynng.NNGException as e:
                raise TransportTimeout(
                    f"no reply to {type(msg).kind} from {self.address}: {e}"
                ) from None
        return decode_message(reply, expect)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            while self._idle:
                self._idle.pop().close()
            self._sock.close()

    def __enter__(self) -> ReqClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> ReqClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------------
# Pub/Sub
# --------------------------------------------------------------------------------------------------


class Publisher:
    """Broadcasts messages to every connected subscriber; never blocks on a slow one (nng drops)."""

    def __init__(
        self, address: str, *, tls: TLS | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._tls = tls
        self._sock = pynng.Pub0(send_timeout=_ms(timeout_s))
        self._listening = False
        self._closed = False
        self._lock = threading.Lock()

    def listen(self) -> str:
        if not self._listening:
            self.address = _listen(self._sock, self.address, self._tls)
            self._listening = True
        return self.address

    async def publish(self, msg: wire.Message) -> None:
        data = wire.encode(msg)
        self.listen()
        try:
            with trio.fail_after(self.timeout_s):
                await self._sock.asend(data)
        except trio.TooSlowError:
            raise TransportTimeout(
                f"publish to {self.address} took over {self.timeout_s:g} s"
            ) from None

    def publish_sync(self, msg: wire.Message) -> None:
        """Blocking :meth:`publish` for code that is not under trio (thread-safe)."""
        data = wire.encode(msg)
        self.listen()
        with self._lock:
            try:
                self._sock.send(data)
            except pynng.Timeout:
                raise TransportTimeout(
                    f"publish to {self.address} took over {self.timeout_s:g} s"
                ) from None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Subscriber:
    """Receives every published message; undecodable ones are skipped and counted, never raised.

    A subscriber only hears messages published after its connection is up (nng Pub/Sub semantics):
    publishers should repeat state (e.g. the current version) rather than announce it once.
    """

    def __init__(
        self,
        address: str,
        *,
        tls: TLS | None = None,
        max_message_bytes: int = wire.MAX_MESSAGE_BYTES,
    ) -> None:
        self.address = address
        self._sock = pynng.Sub0(recv_max_size=max_message_bytes)
        self._sock.subscribe(b"")
        self._closed = False
        self.stats: dict[str, int] = {"received": 0, "bad_messages": 0}
        _dial(self._sock, address, tls)

    async def receive(self, timeout_s: float) -> wire.Message | None:
        """The next good message, or None if none arrives within ``timeout_s``."""
        with trio.move_on_after(timeout_s):
            while True:
                data = await self._sock.arecv()
                try:
                    msg = wire.decode(data)
                except wire.WireError:
                    self.stats["bad_messages"] += 1
                    continue
                self.stats["received"] += 1
                return msg
        return None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
