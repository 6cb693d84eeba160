"""Talking HTTP to a generator (an SGLang server or the built-in engine, same API): the one layer the
rollout's ``/generate`` calls, the reward model's ``/classify`` calls and the broadcaster's weight
calls share (docs/design.md §3).

It owns what they must agree on: clients with the same timeouts, one readiness check (``/health``),
one error (:class:`GeneratorError`: its ``dead`` flag says the server did not answer at all, so the
caller moves on to another server or drops it, while an answer with an error means the server is
alive and refused), and waiting for servers to come up by :mod:`asyncrl.backoff`. What to do on an
error stays with the caller: the pool marks a generator down and retries it after a back-off, the
reward model tries the next server, the broadcaster drops the generator until the next version's
health check.

Every one of these calls is async on trio (:func:`acall`): the broadcaster's weight calls
(:class:`WeightsClient`) are tasks of its loop beside its blocking collective, which alone runs in a
worker thread. :func:`call` on a plain client is for tools and processes without a loop.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any, get_args

import httpx
import trio

from asyncrl import backoff
from asyncrl.recipe import PauseMode
from asyncrl.wire import GeneratorInfo

_ERROR_TEXT = 500  # characters of an error body kept in the message


class GeneratorError(RuntimeError):
    """A generator could not serve: a call failed, an answer broke SGLang's schema, or no generator
    could take a request in time.

    For one failed call: ``url`` and ``path``; ``dead``: no answer at all (unreachable, reset, timed
    out: ``timed_out``); ``status``: the HTTP status of an error answer (a 4xx is :attr:`refused`)."""

    def __init__(
        self,
        message: str,
        *,
        url: str = "",
        path: str = "",
        dead: bool = False,
        status: int | None = None,
        timed_out: bool = False,
    ):
        self.url, self.path, self.message = url, path, message
        self.dead, self.status, self.timed_out = dead, status, timed_out
        super().__init__(f"{url}{path}: {message}" if url or path else message)

    @property
    def refused(self) -> bool:
        """The request itself was bad (HTTP 4xx, e.g. a prompt too long): another server would
        refuse it too, unlike a 5xx or no answer."""
        return self.status is not None and 400 <= self.status < 500


# --------------------------------------------------------------------------------------------------
# Clients and calls
# --------------------------------------------------------------------------------------------------


def _timeout(timeout_s: float, connect_s: float | None) -> httpx.Timeout:
    return httpx.Timeout(timeout_s, connect=timeout_s if connect_s is None else connect_s)


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def sync_client(
    timeout_s: float, *, connect_s: float | None = None, api_key: str | None = None
) -> httpx.Client:
    return httpx.Client(timeout=_timeout(timeout_s, connect_s), headers=_headers(api_key))


def async_client(
    timeout_s: float,
    *,
    connect_s: float | None = None,
    keepalive: int = 20,
    api_key: str | None = None,
) -> httpx.AsyncClient:
    """As many connections as there are requests in flight (the caller bounds those); ``keepalive``
    of them kept open between requests."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=keepalive)
    return httpx.AsyncClient(
        timeout=_timeout(timeout_s, connect_s), limits=limits, headers=_headers(api_key)
    )


def _no_answer(url: str, path: str, e: httpx.TransportError, timeout: float) -> GeneratorError:
    if isinstance(e, httpx.TimeoutException):
        return GeneratorError(
            f"no answer within {timeout:g}s", url=url, path=path, dead=True, timed_out=True
        )
    return GeneratorError(f"unreachable: {e!r}", url=url, path=path, dead=True)


def _answer(url: str, path: str, r: httpx.Response, ok_404: bool) -> Any:
    """The decoded JSON of an answer (None for an empty body, or a 404 if ``ok_404``)."""
    if r.status_code == 404 and ok_404:
        return None
    data: Any = None
    if r.content:
        try:
            data = r.json()
        except ValueError:
            if r.status_code < 400:
                msg = "response is not JSON"
                raise GeneratorError(msg, url=url, path=path, status=r.status_code) from None
    if r.status_code >= 400:
        msg = data.get("message") if isinstance(data, dict) else None
        text = f"HTTP {r.status_code}: {msg or r.text[:_ERROR_TEXT]}"
        raise GeneratorError(text, url=url, path=path, status=r.status_code)
    if isinstance(data, dict) and data.get("success") is False:
        msg = str(data.get("message") or data.get("error_message") or "success: false")
        raise GeneratorError(msg, url=url, path=path, status=r.status_code)
    return data


def _timeouts(http: httpx.Client | httpx.AsyncClient, timeout_s: float | None) -> tuple[Any, float]:
    """This call's timeout for httpx (the client's own, connect timeout included, when None) and
    its seconds for the error message."""
    if timeout_s is None:
        return httpx.USE_CLIENT_DEFAULT, http.timeout.read or 0.0
    return timeout_s, timeout_s


def call(
    http: httpx.Client,
    url: str,
    method: str,
    path: str,
    body: Any = None,
    *,
    timeout_s: float | None = None,
    ok_404: bool = False,
) -> Any:
    """One request to ``url + path``: the decoded JSON answer, or :class:`GeneratorError`.
    ``timeout_s``: this call's, instead of the client's."""
    timeout, seconds = _timeouts(http, timeout_s)
    try:
        r = http.request(method, url + path, json=body, timeout=timeout)
    except httpx.TransportError as e:
        raise _no_answer(url, path, e, seconds) from e
    return _answer(url, path, r, ok_404)


async def acall(
    http: httpx.AsyncClient,
    url: str,
    method: str,
    path: str,
    body: Any = None,
    *,
    timeout_s: float | None = None,
    ok_404: bool = False,
) -> Any:
    """:func:`call` on trio."""
    timeout, seconds = _timeouts(http, timeout_s)
    try:
        r = await http.request(method, url + path, json=body, timeout=timeout)
    except httpx.TransportError as e:
        raise _no_answer(url, path, e, seconds) from e
    return _answer(url, path, r, ok_404)


# --------------------------------------------------------------------------------------------------
# Readiness
# --------------------------------------------------------------------------------------------------

_HEALTH_TIMEOUT_S = 5.0
_POLL_FIRST_S, _POLL_CAP_S = 0.05, 1.0  # a server coming up is asked again soon, then every second


def healthy(http: httpx.Client, url: str, *, timeout_s: float | None = None) -> bool:
    """Whether ``/health`` answers 200: the server is up and its scheduler serves. Only the status
    counts (SGLang's body is empty; another server's may be text)."""
    try:
        call(http, url, "GET", "/health", timeout_s=timeout_s)
        return True
    except GeneratorError as e:
        return e.status == 200


async def ahealthy(http: httpx.AsyncClient, url: str, *, timeout_s: float | None = None) -> bool:
    """:func:`healthy` on trio."""
    try:
        await acall(http, url, "GET", "/health", timeout_s=timeout_s)
        return True
    except GeneratorError as e:
        return e.status == 200


async def wait_healthy(http: httpx.AsyncClient, urls: list[str], timeout_s: float) -> None:
    """Wait until every one of ``urls`` is :func:`healthy`, asking each again after a back-off;
    :class:`GeneratorError` naming those that never were within ``timeout_s``."""
    waiting = list(urls)
    with trio.move_on_after(timeout_s):
        for attempt in itertools.count():
            waiting = [
                u for u in waiting if not await ahealthy(http, u, timeout_s=_HEALTH_TIMEOUT_S)
            ]
            if not waiting:
                return
            await trio.sleep(backoff.delay_s(attempt, first=_POLL_FIRST_S, cap=_POLL_CAP_S))
    raise GeneratorError(f"generators not ready after {timeout_s:.0f}s: {', '.join(waiting)}")


# --------------------------------------------------------------------------------------------------
# Version labels: what the weight calls write and a generation's answer reads back
# --------------------------------------------------------------------------------------------------

_LABEL = re.compile(r"^v?(\d+)$")

BASE_LABEL = "default"
"""SGLang's ``weight_version`` for the weights a server was launched with, when its launch did not
say (``--weight-version``'s default). asyncrl launches generators from ``model.path``, version 0."""


def parse_version_label(label: Any) -> int | None:
    """The policy version in SGLang's free-string ``weight_version``: asyncrl labels generators
    ``"7"`` (``"v7"`` is read as 7 too). Anything else (``"default"``: a server never labelled)
    is None: the version is not known."""
    if isinstance(label, int) and not isinstance(label, bool) and label >= 0:
        return label
    if isinstance(label, str):
        m = _LABEL.match(label.strip())
        if m:
            return int(m.group(1))
    return None


def adapter_name(version: int) -> str:
    """The name an SGLang server loads version ``version``'s LoRA adapter under
    (asyncrl.weights.adapters), and what a request's ``lora_path`` names to be served by it."""
    return f"v{version}"


# --------------------------------------------------------------------------------------------------
# The weight-update calls
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class GroupSpec:
    """One build of the weight-update process group, as ``/init_weights_update_group`` takes it."""

    master_address: str
    master_port: int
    world_size: int
    group_name: str
    backend: str
    timeout_s: float


class WeightsClient:
    """The calls the broadcaster makes to one generator: one method per endpoint of SGLang's
    weight-update API (SGLang 0.5.23's http_server.py; docs/design.md §3), each a coroutine on
    ``http`` (:func:`async_client`: its timeout bounds every call unless a method says otherwise).
    The client is the caller's, shared by every generator's calls and closed by the caller, on the
    trio loop that makes the calls (the broadcaster's sender task)."""

    def __init__(self, info: GeneratorInfo, http: httpx.AsyncClient):
        self.info = info
        self.url = info.url.rstrip("/")
        self._http = http

    async def _call(self, method: str, path: str, body: dict | None = None, **kw: Any) -> Any:
        return await acall(self._http, self.url, method, path, body, **kw)

    async def _object(self, method: str, path: str, **kw: Any) -> dict | None:
        data = await self._call(method, path, **kw)
        if data is not None and not isinstance(data, dict):
            raise GeneratorError("expected a JSON object", url=self.url, path=path)
        return data

    async def health(self, *, timeout_s: float | None = None) -> bool:
        return await ahealthy(self._http, self.url, timeout_s=timeout_s)

    async def model_info(self, *, timeout_s: float | None = None) -> dict:
        data = await self._object("GET", "/model_info", timeout_s=timeout_s)
        if data is None:
            raise GeneratorError("expected a JSON object", url=self.url, path="/model_info")
        return data

    async def server_info(self, *, timeout_s: float | None = None) -> dict | None:
        """SGLang's resolved server arguments (``tp_size``, ``dp_size``...); None where the server has
        no such endpoint (the built-in engine). ``/get_server_info`` is the older name."""
        for path in ("/server_info", "/get_server_info"):
            data = await self._object("GET", path, timeout_s=timeout_s, ok_404=True)
            if data is not None:
                return data
        return None

    async def weight_version(self, *, timeout_s: float | None = None) -> str | None:
        v = (await self.model_info(timeout_s=timeout_s)).get("weight_version")
        return None if v is None else str(v)

    async def pause(self, mode: PauseMode) -> None:
        """Pause generation; ``mode`` is "in_place" or "retract", never "abort" (no lost work)."""
        if mode not in get_args(PauseMode):
            raise ValueError(f"pause mode must be one of {get_args(PauseMode)}, got {mode!r}")
        await self._call("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._call("POST", "/continue_generation", {})

    async def begin(self, *, abandon_open: bool = False) -> bool:
        """Open an update session. False: the server predates sessions (SGLang <= 0.5.20, 404).

        ``abandon_open`` (our extension, for the built-in engine only): a session left open by an
        update that was given up on is discarded first. A generator that takes weights by handle
        joins no group, whose new build would otherwise do that (docs/design.md §4)."""
        body = {"abandon_open": True} if abandon_open and self.info.kind == "builtin" else {}
        return await self._call("POST", "/begin_weight_update", body, ok_404=True) is not None

    async def end(self) -> dict:
        """Close the session. The built-in engine swaps the staged weights in here and reports the
        swap's pause in ``pause_s``."""
        data = await self._call("POST", "/end_weight_update", {})
        return data if isinstance(data, dict) else {}

    async def init_group(self, spec: GroupSpec, *, rank_offset: int) -> None:
        """Join the group; returns once every rank has joined. ``timeout_s`` is our extension
        (SGLang ignores unknown keys): the built-in engine uses it as its group's timeout."""
        body = {
            "master_address": spec.master_address,
            "master_port": spec.master_port,
            "rank_offset": rank_offset,
            "world_size": spec.world_size,
            "group_name": spec.group_name,
            "backend": spec.backend,
            "timeout_s": spec.timeout_s,
        }
        await self._call(
            "POST", "/init_weights_update_group", body, timeout_s=2 * spec.timeout_s + 5
        )

    async def destroy_group(self, group_name: str, *, timeout_s: float | None = None) -> None:
        body = {"group_name": group_name}
        await self._call("POST", "/destroy_weights_update_group", body, timeout_s=timeout_s)

    async def update_from_distributed(
        self,
        meta: dict,
        *,
        group_name: str,
        load_format: str,
        weight_version: str | None,
        flush_cache: bool = False,
        timeout_s: float | None = None,
    ) -> None:
        """Receive one bucket; returns after the broadcast has been received and loaded.

        ``flush_cache`` only after a ``retract`` pause (requests hold no KV then): with ``in_place``
        they stay resident and SGLang answers a flush with 400."""
        body: dict[str, Any] = {
            **meta,
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": False,
        }
        if load_format == "flattened_bucket":
            body["load_format"] = "flattened_bucket"
        if weight_version is not None:
            body["weight_version"] = weight_version
        await self._call("POST", "/update_weights_from_distributed", body, timeout_s=timeout_s)

    async def update_from_tensor(
        self,
        payloads: list[str],
        *,
        weight_version: str | None,
        flush_cache: bool = False,
        timeout_s: float | None = None,
    ) -> None:
        """Take one bucket by handle (SGLang's ``/update_weights_from_tensor``, ``load_format:
        flattened_bucket``; ``payloads``: one :func:`asyncrl.weights.ipc.payload` per rank);
        returns once the server has copied it out of rank 0's memory and loaded it."""
        body: dict[str, Any] = {
            "serialized_named_tensors": payloads,
            "load_format": "flattened_bucket",
            "flush_cache": flush_cache,
            "abort_all_requests": False,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        await self._call("POST", "/update_weights_from_tensor", body, timeout_s=timeout_s)

    async def update_from_disk(self, model_path: str, *, weight_version: str) -> None:
        body = {
            "model_path": model_path,
            "weight_version": weight_version,
            "abort_all_requests": False,
            "flush_cache": False,
        }
        await self._call("POST", "/update_weights_from_disk", body)

    async def relabel(self, version: str) -> None:
        """Label what the server holds with ``version``; running requests go on."""
        body = {"new_version": version, "abort_all_requests": False}
        await self._call("POST", "/update_weight_version", body)

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """SGLang (``--enable-lora``): load the PEFT adapter folder ``path`` as ``name``."""
        await self._call("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": path})

    async def unload_lora_adapter(self, name: str) -> None:
        """SGLang: unload adapter ``name`` (it answers once the requests that use it are done)."""
        await self._call("POST", "/unload_lora_adapter", {"lora_name": name})

    async def checksum(self, *, sample: int = 0) -> str | None:
        """The server's weights checksum (:func:`asyncrl.weights.buckets.checksum`, ``sample`` values
        per tensor; 0: all), or None if it gives none we can compare (SGLang's own
        ``per_engine_checksum`` hashes differently, per fused parameter)."""
        body: dict = {"action": "checksum"}
        if sample and self.info.kind == "builtin":  # SGLang's request schema has no such key
            body["sample"] = sample
        data = await self._call("POST", "/weights_checker", body)
        if not isinstance(data, dict):
            return None
        c = data.get("checksum")
        return c if isinstance(c, str) else None
