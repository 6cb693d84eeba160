"""Real nng sockets on loopback: ipc, tcp and mutual-TLS tcp (certificates made here by trustme)."""

from __future__ import annotations

import gc
import math
import tempfile
import weakref
from pathlib import Path

import numpy as np
import pynng
import pytest
import trio
import trustme

from asyncrl import transport, wire
from asyncrl.recipe import BufferConfig, Recipe, TLSConfig
from asyncrl.transport import (
    TLS,
    Publisher,
    RepServer,
    ReqClient,
    Subscriber,
    TransportTimeout,
)

WAIT_S = 20.0  # generous bound for "should happen": the test machine is loaded
REFUSED_S = 1.5  # how long a refused request is given before we call it refused


def _write_pair(ca: trustme.CA, d: Path, name: str, *identities: str) -> TLS:
    cert = ca.issue_cert(*identities)
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.crt").write_bytes(b"".join(p.bytes() for p in cert.cert_chain_pems))
    (d / f"{name}.key").write_bytes(cert.private_key_pem.bytes())
    (d / "ca.pem").write_bytes(ca.cert_pem.bytes())
    return TLS(cert=str(d / f"{name}.crt"), key=str(d / f"{name}.key"), ca=str(d / "ca.pem"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, TLS]:
    """A server and client signed by one CA, and a client signed by another (an intruder)."""
    d = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    return {
        "server": _write_pair(ca, d / "ok", "server", "localhost", "127.0.0.1"),
        "client": _write_pair(ca, d / "ok", "client", "client.asyncrl"),
        "intruder": _write_pair(other, d / "other", "intruder", "client.asyncrl"),
    }


@pytest.fixture
def ipc_dir():
    # ipc paths are limited to ~100 bytes; pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="arl") as d:
        yield d


@pytest.fixture(params=["ipc", "tcp", "tls"])
def endpoint(request, pki, ipc_dir):
    """(server address, server tls, client tls); the server binds port 0 where it can."""
    if request.param == "ipc":
        return f"ipc://{ipc_dir}/rep.sock", None, None
    if request.param == "tcp":
        return "tcp://127.0.0.1:0", None, None
    return "tls+tcp://127.0.0.1:0", pki["server"], pki["client"]


def _sample(i: int, n_prompt: int = 5, n_completion: int = 7) -> wire.Sample:
    return wire.Sample(
        id=f"s{i}",
        group_id="g",
        prompt_ids=np.arange(n_prompt, dtype=np.int32),
        completion_ids=np.arange(n_completion, dtype=np.int32),
        behavior_logprobs=-np.ones(n_completion, dtype=np.float32),
        versions=np.zeros(n_completion, dtype=np.int32),
        loss_mask=np.ones(n_completion, dtype=np.float32),
        reward=float(i),
    )


def _echo(msg: wire.Message) -> wire.Message:
    """Replies with something that depends on the request, so a wrong pairing would show."""
    if isinstance(msg, wire.Acquire):
        return wire.Grant(lease_id=msg.worker_id, starts=msg.starts, version=3, lease_seconds=1.0)
    if isinstance(msg, wire.Put):
        return wire.Ack(group_ids=[g.id for g in msg.groups])
    if isinstance(msg, wire.Status):
        return wire.StatusReply(version=7)
    raise RuntimeError(f"the handler fails on {msg.kind}")


async def _until(predicate) -> None:
    """Wait for a condition (a reply reaches the client before the server counts it as sent)."""
    with trio.fail_after(WAIT_S):
        while not predicate():
            await trio.sleep(0.005)


async def _serving(nursery, server: RepServer, handler=_echo) -> RepServer:
    server.listen()
    nursery.start_soon(server.serve, handler)
    return server


def test_req_rep_round_trip_and_concurrency(endpoint):
    address, server_tls, client_tls = endpoint

    async def main():
        async with trio.open_nursery() as n:
            server = await _serving(n, RepServer(address, tls=server_tls))
            assert ":0" not in server.address.rsplit("/", 1)[-1]
            async with ReqClient(server.address, tls=client_tls, timeout_s=WAIT_S) as client:
                group = wire.Group(id="g", samples=[_sample(i) for i in range(3)])
                ack = await client.request(wire.Put(worker_id="w", groups=[group]))
                assert ack == wire.Ack(group_ids=["g"])
                replies: dict[int, wire.Message] = {}

                async def one(i: int) -> None:
                    replies[i] = await client.request(wire.Acquire(worker_id=f"w{i}", starts=i))

                async with trio.open_nursery() as inner:  # several requests in flight at once
                    for i in range(20):
                        inner.start_soon(one, i)
                assert all(
                    replies[i].lease_id == f"w{i}" and replies[i].starts == i for i in range(20)
                )
                sync_reply = await trio.to_thread.run_sync(
                    lambda: client.request_sync(wire.Status(), expect=wire.StatusReply)
                )
                assert sync_reply.version == 7
            await _until(lambda: server.stats["replied"] == 22)
            assert server.stats == {
                "received": 22,
                "replied": 22,
                "bad_messages": 0,
                "handler_errors": 0,
            }
            server.close()

    trio.run(main)


def _large_samples() -> list[wire.Sample]:
    """Five samples of 4,000 tokens: an ~400 KB message, over transport._IN_PLACE_FROM."""
    rng = np.random.default_rng(0)
    n = 4000
    return [
        wire.Sample(
            id=f"s{i}",
            group_id="big",
            prompt_ids=rng.integers(0, 1000, 50, dtype=np.int32),
            completion_ids=rng.integers(0, 1000, n, dtype=np.int32),
            behavior_logprobs=-rng.random(n, dtype=np.float32),
            versions=np.full(n, i, dtype=np.int32),
            loss_mask=np.ones(n, dtype=np.float32),
        )
        for i in range(5)
    ]


def test_large_messages_are_read_in_place_and_outlive_their_sockets():
    """Over 64 KB, a received message is decoded as views into nng's buffer (server and client
    side): the views must stay valid, and read-only, after the sockets are long gone."""
    sent = _large_samples()
    put = wire.Put(worker_id="w", groups=[wire.Group(id="big", samples=sent)])
    assert len(wire.encode(put)) > transport._IN_PLACE_FROM
    kept: list[wire.Group] = []

    def keep(msg: wire.Message) -> wire.Message:
        if isinstance(msg, wire.Put):
            kept.extend(msg.groups)
            return wire.Ack(group_ids=[g.id for g in msg.groups])
        return wire.Group(id="big", samples=sent)  # the Status request gets a large reply

    async def main():
        async with trio.open_nursery() as nursery:
            server = await _serving(nursery, RepServer("tcp://127.0.0.1:0"), keep)
            async with ReqClient(server.address, timeout_s=WAIT_S) as client:
                assert await client.request(put) == wire.Ack(group_ids=["big"])
                echoed = await trio.to_thread.run_sync(
                    lambda: client.request_sync(wire.Status(), expect=wire.Group)
                )
            server.close()
        return echoed

    echoed = trio.run(main)
    gc.collect()
    for got in (kept[0], echoed):
        for a, b in zip(got.samples, sent, strict=True):
            for name in wire.TOKEN_ARRAYS:
                x = getattr(a, name)
                assert np.array_equal(x, getattr(b, name)), name
                assert not x.flags.writeable


def test_decoded_views_keep_the_received_nng_message_alive():
    """The views hold the nng message (not a copy): it lives exactly as long as they do."""
    put = wire.Put(worker_id="w", groups=[wire.Group(id="big", samples=_large_samples())])
    with pynng.Pair0(listen="inproc://keepalive") as a, pynng.Pair0(dial="inproc://keepalive") as b:
        a.send(wire.encode(put))
        m = b.recv_msg()
    alive = weakref.ref(m)
    start = int(transport.ffi.cast("uintptr_t", transport.lib.nng_msg_body(m._nng_msg)))
    got = transport.decode_message(m, wire.Put)
    del m
    gc.collect()
    assert alive() is not None
    view = wire.group_tokens(got.groups[0], "versions")
    assert 0 < view.__array_interface__["data"][0] - start < len(wire.encode(put))  # in place
    assert view.tolist() == np.repeat(np.arange(5), 4000).tolist()
    del got, view
    gc.collect()
    assert alive() is None


def test_bad_bytes_and_handler_errors_get_error_replies_and_service_continues():
    async def main():
        async with trio.open_nursery() as n:
            server = await _serving(n, RepServer("tcp://127.0.0.1:0"))
            with pynng.Req0(dial=server.address, recv_timeout=20_000, send_timeout=20_000) as raw:
                for junk in (b"", b"\xff\x00garbage", wire.encode(wire.Status())[:-1]):
                    await raw.asend(junk)
                    reply = wire.decode(await raw.arecv())
                    assert isinstance(reply, wire.Error) and reply.code == "bad_message"
            async with ReqClient(server.address, timeout_s=WAIT_S) as client:
                err = await client.request(wire.Register(worker_id="w", generators=[]))
                assert isinstance(err, wire.Error) and err.code == "internal"
                assert "the handler fails on register" in err.message
                assert (await client.request(wire.Status())).version == 7
            await _until(lambda: server.stats["replied"] == 5)
            assert server.stats["bad_messages"] == 3
            assert server.stats["handler_errors"] == 1
            server.close()

    trio.run(main)


def test_async_handler():
    async def handler(msg):
        await trio.sleep(0)
        return wire.Ok(message=msg.kind)

    async def main():
        async with trio.open_nursery() as n:
            server = await _serving(n, RepServer("tcp://127.0.0.1:0"), handler)
            async with ReqClient(server.address, timeout_s=WAIT_S) as client:
                assert (await client.request(wire.Status())).message == "status"
            server.close()

    trio.run(main)


def test_timed_out_and_cancelled_requests_end_promptly_and_leave_the_client_usable():
    """nng enforces each request's timeout, trio cancellation cancels the nng operation, and a
    context whose request failed is never reused, so a late reply cannot answer a later request."""
    late = trio.Event()

    async def handler(msg):
        if isinstance(msg, wire.Acquire) and msg.worker_id == "slow":
            await late.wait()
        return _echo(msg)

    async def main():
        async with trio.open_nursery() as n:
            server = await _serving(n, RepServer("tcp://127.0.0.1:0"), handler)
            async with ReqClient(server.address, timeout_s=WAIT_S) as client:
                for _ in range(5):  # sequential requests take the one context in turn
                    assert (await client.request(wire.Status())).version == 7
                assert len(client._idle) == 1

                start = trio.current_time()
                with pytest.raises(TransportTimeout, match="acquire"):
                    await client.request(wire.Acquire(worker_id="slow", starts=1), timeout_s=0.3)
                assert 0.25 <= trio.current_time() - start < REFUSED_S
                with trio.move_on_after(0.3) as scope:
                    await client.request(wire.Acquire(worker_id="slow", starts=2))
                assert scope.cancelled_caught and trio.current_time() - start < 2 * REFUSED_S
                assert client._idle == []  # both failed contexts were closed

                late.set()  # the server now answers both abandoned requests
                await _until(lambda: server.stats["replied"] == 7)
                for i in range(3):
                    grant = await client.request(wire.Acquire(worker_id=f"w{i}", starts=i))
                    assert (grant.lease_id, grant.starts) == (f"w{i}", i)
                assert (await client.request(wire.Status(), timeout_s=math.inf)).version == 7
                forever = await trio.to_thread.run_sync(
                    lambda: client.request_sync(wire.Status(), timeout_s=math.inf)
                )
                assert forever.version == 7
            server.close()

    trio.run(main)


def test_oversized_request_is_refused_and_server_keeps_serving():
    async def main():
        async with trio.open_nursery() as n:
            server = await _serving(n, RepServer("tcp://127.0.0.1:0", max_message_bytes=64 * 1024))
            # A group that encodes to ~1 MB; nng drops it (and the connection) before decoding.
            big = wire.Group(id="g", samples=[_sample(0, n_prompt=10, n_completion=100_000)])
            async with ReqClient(server.address, timeout_s=WAIT_S) as client:
                with pytest.raises(TransportTimeout):
                    await client.request(wire.Put(worker_id="w", groups=[big]), timeout_s=REFUSED_S)
                # The same client reconnects and is served.
                assert (await client.request(wire.Status())).version == 7
            assert server.stats["received"] == 1  # the oversized request never reached Python
            server.close()

    trio.run(main)


@pytest.mark.parametrize("who", ["no_cert", "intruder", "plain_tcp"])
def test_tls_refuses_clients_without_the_right_certificate(pki, who):
    async def main():
        async with trio.open_nursery() as n:
            server = await _serving(n, RepServer("tls+tcp://127.0.0.1:0", tls=pki["server"]))
            if who == "no_cert":
                sock = pynng.Req0(
                    tls_config=pynng.TLSConfig(
                        pynng.TLSConfig.MODE_CLIENT,
                        server_name="127.0.0.1",
                        ca_files=[pki["client"].ca],
                    )
                )
                sock.dial(server.address, block=False)
                with sock, trio.move_on_after(REFUSED_S) as scope:
                    await sock.asend(wire.encode(wire.Status()))
                    await sock.arecv()
                assert scope.cancelled_caught, "a client without a certificate was served"
            else:
                if who == "intruder":
                    bad = ReqClient(server.address, tls=pki["intruder"], timeout_s=REFUSED_S)
                else:
                    bad = ReqClient(server.address.replace("tls+tcp", "tcp"), timeout_s=REFUSED_S)
                with bad, pytest.raises(TransportTimeout):
                    await bad.request(wire.Status())
            assert server.stats["received"] == 0
            async with ReqClient(server.address, tls=pki["client"], timeout_s=WAIT_S) as good:
                assert (await good.request(wire.Status())).version == 7
            server.close()

    trio.run(main)


def test_client_started_before_server_connects_when_it_comes_up(ipc_dir):
    address = f"ipc://{ipc_dir}/late.sock"

    async def main():
        async with ReqClient(address, timeout_s=WAIT_S) as client:
            with pytest.raises(TransportTimeout):
                await client.request(wire.Status(), timeout_s=0.2)
            async with trio.open_nursery() as n:
                server = await _serving(n, RepServer(address))
                assert (await client.request(wire.Status())).version == 7
                server.close()

    trio.run(main)


def test_client_survives_a_server_restart(ipc_dir):
    address = f"ipc://{ipc_dir}/restart.sock"

    async def main():
        async with ReqClient(address, timeout_s=WAIT_S) as client:
            async with trio.open_nursery() as n:
                first = await _serving(n, RepServer(address))
                assert (await client.request(wire.Status())).version == 7
                first.close()
            async with trio.open_nursery() as n:
                second = await _serving(n, RepServer(address))
                with trio.fail_after(WAIT_S):  # the caller's resend loop
                    while True:
                        try:
                            reply = await client.request(wire.Status(), timeout_s=1.0)
                            break
                        except TransportTimeout:
                            continue
                assert reply.version == 7 and second.stats["received"] >= 1
                second.close()

    trio.run(main)


def test_request_sync_times_out_without_server(ipc_dir):
    with (
        ReqClient(f"ipc://{ipc_dir}/nobody.sock", timeout_s=0.2) as client,
        pytest.raises(TransportTimeout, match="status"),
    ):
        client.request_sync(wire.Status())


def test_a_publisher_takes_an_infinite_timeout():
    with Publisher("inproc://forever", timeout_s=math.inf) as pub:
        pub.listen()
        with Subscriber(pub.address) as sub:

            async def main():
                with trio.fail_after(WAIT_S):  # heard once the subscription is up
                    while (got := await sub.receive(timeout_s=0.05)) is None:
                        pub.publish_sync(wire.Version(version=3))
                return got

            assert trio.run(main) == wire.Version(version=3)


def test_pub_sub_skips_bad_messages(endpoint):
    address, server_tls, client_tls = endpoint

    async def main():
        with Publisher(address, tls=server_tls) as pub:
            pub.listen()
            with Subscriber(pub.address, tls=client_tls) as sub:
                # Subscribers only hear what is sent after they connect: repeat until heard.
                got = None
                with trio.fail_after(WAIT_S):
                    while got is None:
                        await pub.publish(wire.Version(version=1, checkpoint="/ckpt/1"))
                        got = await sub.receive(timeout_s=0.05)
                assert got == wire.Version(version=1, checkpoint="/ckpt/1")
                assert await sub.receive(timeout_s=0.01) in (None, got)  # drain a repeat or two
                while await sub.receive(timeout_s=0.05) is not None:
                    pass
                pub._sock.send(b"\x00not msgpack")  # a raw bad message on the same socket
                pub.publish_sync(wire.Version(version=2))
                assert await sub.receive(timeout_s=WAIT_S) == wire.Version(version=2)
                assert sub.stats["bad_messages"] == 1
                assert await sub.receive(timeout_s=0.05) is None

    trio.run(main)


def test_tls_from_config_and_address_checks(pki):
    assert TLS.from_config(BufferConfig()) is None
    t = pki["client"]
    cfg = BufferConfig(tls=TLSConfig(cert=t.cert, key=t.key, ca=t.ca))
    assert TLS.from_config(cfg) == TLS(cert=t.cert, key=t.key, ca=t.ca)
    assert TLS.from_config(cfg.tls) == TLS(cert=t.cert, key=t.key, ca=t.ca)
    d = Path(t.ca).parent
    rel = Recipe(
        buffer=BufferConfig(tls=TLSConfig(cert="client.crt", key="client.key", ca="ca.pem"))
    )
    rel.base_dir = str(d)
    assert TLS.from_config(rel) == TLS(cert=t.cert, key=t.key, ca=t.ca)
    assert TLS.from_config(Recipe()) is None
    with pytest.raises(ValueError, match="needs a TLS"):
        ReqClient("tls+tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="must be tls"):
        ReqClient("tcp://127.0.0.1:1", tls=t)
    ReqClient("inproc://local", tls=t).close()  # local transports take no TLS
    assert transport.free_tcp_address().startswith("tcp://127.0.0.1:")
