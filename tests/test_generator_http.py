"""The one HTTP layer to a generator: every way a call can fail is the same GeneratorError, with the
same message, from the sync calls (tools, processes without a loop) and the async ones (the
rollout's, the weight path's); readiness waits by the back-off. Against real HTTP servers on loopback: the built-in engine for what a serving generator
answers, and a small scripted server for the faults a healthy engine never gives (5xx, ``success:
false``, a body that is not JSON, no answer at all). And the version labels' format, which the
weight calls write and the rollout's reads back."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import trio

from asyncrl.generator_http import (
    GeneratorError,
    WeightsClient,
    acall,
    async_client,
    call,
    parse_version_label,
    sync_client,
    wait_healthy,
)
from asyncrl.wire import GeneratorInfo
from tests.ports import refused_url


class _Scripted(BaseHTTPRequestHandler):
    """Answers each path with its scripted (status, body) replies in turn, the last one for ever;
    ``/hang`` reads the request and does not answer until the test ends; a path under ``/silent/``
    does not answer either, and sets ``given_up`` once the client has closed the connection."""

    replies: dict[str, list[tuple[int, bytes]]] = {}
    hits: dict[str, int] = {}
    release = threading.Event()
    given_up = threading.Event()

    def log_message(self, *a):
        pass

    def _reply(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        n = self.hits[self.path] = self.hits.get(self.path, 0) + 1
        if self.path == "/hang":
            self.release.wait(30)
            return
        if self.path.startswith("/silent/"):
            self.connection.settimeout(30)
            if self.connection.recv(1) == b"":  # the client closed it
                self.given_up.set()
            return
        script = self.replies[self.path]
        status, body = script[min(n, len(script)) - 1]
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _reply


@pytest.fixture
def scripted() -> Iterator[str]:
    _Scripted.hits, _Scripted.replies = {}, {}
    _Scripted.release.clear()
    _Scripted.given_up.clear()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    _Scripted.release.set()
    httpd.shutdown()


def _json(obj) -> bytes:
    return json.dumps(obj).encode()


def _outcomes(url: str, requests: list[tuple[str, dict]]) -> tuple[list, list]:
    """Each request made by the sync call and by the async one: its answer, or its error."""

    def outcome(fn):
        try:
            return fn()
        except GeneratorError as e:
            return (str(e), e.dead, e.timed_out, e.status, e.refused)

    with sync_client(5.0) as http:
        sync = [
            outcome(lambda p=p, kw=kw: call(http, url, "POST", p, {}, **kw)) for p, kw in requests
        ]

    async def run():
        out = []
        async with async_client(5.0) as http:
            for p, kw in requests:
                try:
                    out.append(await acall(http, url, "POST", p, {}, **kw))
                except GeneratorError as e:
                    out.append((str(e), e.dead, e.timed_out, e.status, e.refused))
        return out

    return sync, trio.run(run)


def test_every_failure_is_one_generator_error_the_same_sync_and_async(scripted):
    _Scripted.replies = {
        "/ok": [(200, _json({"weight_version": "3"}))],
        "/empty": [(200, b"")],
        "/gone": [(404, b"not found")],
        "/overloaded": [(503, _json({"message": "overloaded"}))],
        "/bad": [(400, b"prompt too long")],
        "/refused": [(200, _json({"success": False, "message": "no such group"}))],
        "/text": [(200, b"hello")],
    }
    requests = [
        ("/ok", {}),
        ("/empty", {}),
        ("/gone", {"ok_404": True}),
        ("/gone", {}),
        ("/overloaded", {}),
        ("/bad", {}),
        ("/refused", {}),
        ("/text", {}),
        ("/hang", {"timeout_s": 0.3}),
    ]
    sync, async_ = _outcomes(scripted, requests)
    assert sync == async_
    u = scripted
    assert sync == [
        {"weight_version": "3"},
        None,
        None,  # a 404 the caller expects (an endpoint the server predates)
        (f"{u}/gone: HTTP 404: not found", False, False, 404, True),
        (f"{u}/overloaded: HTTP 503: overloaded", False, False, 503, False),
        (f"{u}/bad: HTTP 400: prompt too long", False, False, 400, True),
        (f"{u}/refused: no such group", False, False, 200, False),
        (f"{u}/text: response is not JSON", False, False, 200, False),
        (f"{u}/hang: no answer within 0.3s", True, True, None, False),
    ]


def test_a_server_that_does_not_listen_is_dead_for_both_paths():
    async def weights_calls(nobody: str) -> tuple[bool, GeneratorError]:
        async with async_client(2.0) as http:
            client = WeightsClient(GeneratorInfo(url=nobody), http)
            with pytest.raises(GeneratorError, match="unreachable") as e:
                await client.weight_version()
            return await client.health(), e.value

    with refused_url() as nobody:  # held, not listening, for the whole test
        sync, async_ = _outcomes(nobody, [("/generate", {})])
        healthy, e = trio.run(weights_calls, nobody)
    for message, dead, timed_out, status, refused in (sync[0], async_[0]):
        assert message.startswith(f"{nobody}/generate: unreachable: ConnectError")
        assert (dead, timed_out, status, refused) == (True, False, None, False)
    assert healthy is False
    assert e.dead and e.url == nobody and e.path == "/model_info"


def test_wait_healthy_asks_again_until_a_server_is_up_and_names_one_that_never_is(scripted):
    _Scripted.replies = {"/health": [(503, b"")] * 3 + [(200, b"OK")]}  # text: up all the same

    async def run(nobody: str):
        async with async_client(5.0) as http:
            await wait_healthy(http, [scripted], 30)
            asked = _Scripted.hits["/health"]
            with pytest.raises(GeneratorError, match="not ready after 1s") as e:
                await wait_healthy(http, [scripted, nobody], 1)
            return asked, str(e.value)

    with refused_url() as nobody:
        asked, err = trio.run(run, nobody)
    assert asked == 4  # three 503s (starting up), then the 200 it waited for
    assert err.endswith(f": {nobody}")  # only the one that never answered


def test_weight_calls_as_tasks_on_one_client_against_the_engine(rollout_engine):
    """The broadcaster's calls to a generator are tasks of its loop, several at once on the one
    client its sender made, as the rollout's ``/generate`` calls are."""
    info = GeneratorInfo(url=rollout_engine.url)

    async def run():
        out: dict = {}

        async def task(name, fn):
            out[name] = await fn()

        async with async_client(30.0) as http, trio.open_nursery() as n:
            client = WeightsClient(info, http)
            n.start_soon(task, "health", client.health)
            n.start_soon(task, "version", client.weight_version)
            n.start_soon(task, "checksum", client.checksum)
            out["model_info"] = await acall(http, rollout_engine.url, "GET", "/model_info")
        return out

    out = trio.run(run)
    assert out["health"] is True
    assert out["version"] == out["model_info"]["weight_version"]
    assert isinstance(out["checksum"], str) and out["checksum"]


def test_a_generator_silent_past_the_bound_is_given_up_at_once_and_alone(scripted):
    """The broadcaster's wait on its generators' calls (FanOut.each) is bounded: one that has not
    answered when the bound passes fails alone (the other's answer is kept), and its request is
    cancelled then, its connection closed while the client stays open for the next calls. A call
    run in a worker thread could only be abandoned: it held the connection until the client's own
    timeout (60 s here)."""
    from asyncrl.weights.fanout import FanOut
    from asyncrl.weights.members import Member

    _Scripted.replies = {"/ok/end_weight_update": [(200, _json({"success": True, "pause_s": 0.1}))]}
    infos = [GeneratorInfo(url=f"{scripted}/ok"), GeneratorInfo(url=f"{scripted}/silent")]

    async def run():
        async with async_client(60.0) as http:
            members = [Member(info=i, client=WeightsClient(i, http)) for i in infos]
            ok, bad = await FanOut(nice=False).each(members, lambda m: m.client.end(), 0.5)
            closed = await trio.to_thread.run_sync(_Scripted.given_up.wait, 20)
            return ok, bad, closed, http.is_closed

    ok, bad, closed, client_closed = trio.run(run)
    assert ok == {f"{scripted}/ok": {"success": True, "pause_s": 0.1}}
    (e,) = bad.values()
    assert list(bad) == [f"{scripted}/silent"]
    assert isinstance(e, GeneratorError) and e.dead and str(e).endswith("no answer within 0.5s")
    assert closed and not client_closed


def test_the_pool_moves_a_request_off_a_5xx_generator_but_not_off_a_refusal(
    scripted, rollout_engine
):
    """What the pool does with the one error: an answer of 5xx (a server in trouble) marks that
    generator down and the request goes to another; a 4xx says the request itself is bad, and
    another generator would refuse it too, so it fails where it is."""
    from asyncrl.rollout.generator_pool import GeneratorPool
    from asyncrl.rollout.sglang_protocol import SamplingParams
    from tests.labels import get_label, set_label

    _Scripted.replies = {"/generate": [(503, _json({"message": "overloaded"}))]}
    params = SamplingParams(max_new_tokens=4, temperature=0.0)

    async def go():
        async with GeneratorPool([scripted, rollout_engine.url], retry_s=30.0) as pool:
            for g in pool.generators.values():  # as after label(): both hold version 0
                g.version = 0
            done = [await pool.generate([5, 6, 7, i], params) for i in range(3)]
            sick = pool.generators[scripted]
            marked = (sick.failures, sick.last_error)
            _Scripted.replies["/generate"] = [(400, b"prompt too long")]
            sick.down_until, sick.version = 0.0, 0  # back up: it is asked first (in order)
            pool.generators[rollout_engine.url].in_flight = 1  # so the pick is the scripted one
            with pytest.raises(GeneratorError, match="HTTP 400: prompt too long") as e:
                await pool.generate([5, 6, 7], params)
            return done, marked, sick.failures, e.value

    before = get_label(rollout_engine.url)
    set_label(rollout_engine.url, "0")
    try:
        done, marked, failures, refused = trio.run(go)
    finally:
        set_label(rollout_engine.url, before)
    assert all(c.generator == rollout_engine.url for c in done)
    assert _Scripted.hits["/generate"] == 2  # 1 503 (then down), 1 refusal: nothing retried there
    assert marked == (1, "HTTP 503: overloaded")
    assert failures == 1  # the refusal is no failure of the server: it stays up
    assert refused.refused and refused.url == scripted and not refused.dead


def test_version_labels():
    assert parse_version_label("7") == 7
    assert parse_version_label("v12") == 12
    assert parse_version_label(3) == 3
    for unknown in ("default", None, "", "v", "-1", "1.5", True, -2):
        assert parse_version_label(unknown) is None
