"""The buffer service over real nng on loopback: requests, dedup, bad input, versions, resume."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading

import msgpack
import numpy as np
import pynng
import pytest
import trio
import trustme

from asyncrl import wire
from asyncrl.buffer.client import BufferClient, BufferRefused
from asyncrl.buffer.service import BufferService
from asyncrl.recipe import BufferConfig, TLSConfig
from asyncrl.transport import TLS, Subscriber, TransportTimeout, free_tcp_address
from tests.buffer.test_store import make_group
from tests.ports import refused_url


def config(**kw) -> BufferConfig:
    base = dict(  # a fixed depth: these tests count starts against it
        groups_per_batch=2,
        max_staleness=0,
        lease_seconds=30.0,
        batch_timeout_s=20.0,
        adaptive_depth_wait=False,
    )
    return BufferConfig(**{**base, **kw})


@pytest.fixture
def service():
    svc = BufferService(config(), announce_every_s=0.2).start()
    yield svc
    svc.stop()


def run(fn, *args):
    return trio.run(fn, *args)


def test_acquire_put_ack_dedup_batch(service: BufferService) -> None:
    async def worker() -> None:
        async with BufferClient(service.address, worker_id="w1") as c:
            grant = await c.acquire(3, request_id="a1")
            assert (grant.starts, grant.version) == (2, 0)  # B = 2 at max_staleness 0
            assert (await c.acquire(3, request_id="a1")).lease_id == grant.lease_id  # resent
            assert (await c.acquire(1)).starts == 0  # at the bound
            groups = [make_group(f"g{i}", grant.lease_id, versions=[0, 0]) for i in range(2)]
            ack = await c.put(groups)
            assert ack.group_ids == ["g0", "g1"] and not ack.rejected
            again = await c.put(groups)  # a resend after a lost reply: acked, not stored twice
            assert again.group_ids == ["g0", "g1"]
            status = await c.status()
            assert status.stats["occupancy"] == 2 and status.stats["duplicates"] == 2

    run(worker)
    batch = service.next_batch(timeout_s=10)
    assert [g.id for g in batch.groups] == ["g0", "g1"] and batch.version == 0
    assert batch.groups[0].samples[0].completion_ids.tolist() == [7, 8, 9]
    with pytest.raises(TimeoutError, match="no batch of 2 groups within 0.2 s at version 0"):
        service.next_batch(timeout_s=0.2)


def test_next_batch_waits_for_a_put_from_another_thread(service: BufferService) -> None:
    """The learner blocks in next_batch; a worker's put wakes it (no polling on the test side)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(service.next_batch(timeout_s=20)))
    t.start()

    async def worker() -> None:
        async with BufferClient(service.address, worker_id="w") as c:
            grant = await c.acquire(2)
            await c.put([make_group(f"x{i}", grant.lease_id, versions=[0]) for i in range(2)])

    run(worker)
    t.join(20)
    assert [g.id for g in out[0].groups] == ["x0", "x1"]


def test_versions_reach_a_subscriber(service: BufferService) -> None:
    async def listen() -> list[int]:
        seen: list[int] = []
        with Subscriber(service.pub_address) as sub:
            with trio.fail_after(20):
                while not seen or seen[-1] < 3:
                    msg = await sub.receive(timeout_s=5)
                    if isinstance(msg, wire.Version):
                        seen.append(msg.version)
                        if msg.version == 0:  # connected: the learner moves on
                            service.set_version(msg.version + 3, checkpoint="/tmp/ckpt-3")
                        if msg.version == 3:
                            assert msg.checkpoint == "/tmp/ckpt-3" and msg.max_staleness == 0
        return seen

    seen = run(listen)
    assert seen[0] == 0 and seen[-1] == 3 and seen == sorted(seen)


def test_end_of_run_is_announced_and_refuses_new_starts(service: BufferService) -> None:
    """After end_run the subscribers hear End (repeated, so a late one hears it too), Acquire and
    Register get run_ended, and the starts still out can be given back."""

    async def worker() -> None:
        async with BufferClient(service.address, worker_id="w") as c:
            await c.register([wire.GeneratorInfo(url="http://127.0.0.1:1")])
            service.set_version(4)
            grant = await c.acquire(2)
            assert grant.starts == 2
            assert service.stats()["workers_registered"] == 1
            assert not service.stats()["ended"]
            service.end_run("trained 4 versions")
            with Subscriber(service.pub_address) as sub:  # connects after the first announcement
                with trio.fail_after(20):
                    while not isinstance(msg := await sub.receive(timeout_s=5), wire.End):
                        pass
            assert (msg.version, msg.message) == (4, "trained 4 versions")
            with pytest.raises(BufferRefused, match="run_ended: trained 4 versions"):
                await c.acquire(1)
            with pytest.raises(BufferRefused, match="run_ended"):
                await c.register([wire.GeneratorInfo(url="http://127.0.0.1:1")])
            assert isinstance(await c.release(grant.lease_id, grant.starts), wire.Ok)
            assert (await c.status()).stats["ended"]

    run(worker)


def test_register_runs_callbacks(service: BufferService) -> None:
    calls: list = []
    service.on_register(lambda wid, gens: calls.append((wid, [g.url for g in gens])))

    async def worker() -> None:
        async with BufferClient(service.address, worker_id="w7") as c:
            ok = await c.register([wire.GeneratorInfo(url="http://127.0.0.1:1234")])
            assert isinstance(ok, wire.Ok)

            def broken(wid, gens):
                raise RuntimeError("rendezvous refused")

            service.on_register(broken)
            with pytest.raises(BufferRefused, match="register_failed: RuntimeError: rendezvous"):
                await c.register([])
            assert (await c.acquire(1)).starts == 1  # still serving

    run(worker)
    assert calls[0] == ("w7", ["http://127.0.0.1:1234"])


def test_a_fresh_register_takes_back_the_leases_of_the_dead_process(service: BufferService):
    """A worker restarted after kill -9: its first (fresh) register ends the leases its old process
    held, so their starts come back now rather than after lease_seconds; another worker's stay."""

    async def go() -> None:
        gen = [wire.GeneratorInfo(url="http://127.0.0.1:1234")]
        async with (
            BufferClient(service.address, worker_id="w1") as dead,
            BufferClient(service.address, worker_id="w2") as other,
        ):
            assert (await dead.acquire(1)).starts == 1 and (await other.acquire(1)).starts == 1
            assert (await other.acquire(1)).starts == 0  # B = 2 at max_staleness 0: all given
            await dead.register(gen)  # not fresh (e.g. after a learner restart): leases kept
            assert (await other.acquire(1)).starts == 0
        async with BufferClient(service.address, worker_id="w1") as restarted:
            await restarted.register(gen, fresh=True)
            stats = (await restarted.status()).stats
            assert stats["abandoned"] == 1 and stats["leases_live"] == 1  # w2's is kept
            assert (await restarted.acquire(2)).starts == 1  # the start came back

    run(go)


def _bad_messages(lease_id: str) -> list[tuple[bytes, str]]:
    """Malformed, oversized and out-of-order requests, with the error code each must get."""
    body = lambda kind, **kw: msgpack.packb({"kind": kind, "v": wire.SCHEMA_VERSION, **kw})  # noqa: E731
    ack = wire.encode(wire.Ack(group_ids=["x"]))
    grant = wire.encode(wire.Grant(lease_id="l", starts=1, version=0, lease_seconds=1.0))
    huge = make_group("huge", lease_id, versions=[0])
    huge.samples[0].prompt_ids = np.zeros(wire.MAX_TOKENS + 1, dtype=np.int32)
    return [
        (b"", "bad_message"),
        (b"\xc1garbage", "bad_message"),
        (msgpack.packb([1, 2, 3]), "bad_message"),
        (body("nonsense"), "bad_message"),
        (msgpack.packb({"kind": "acquire", "v": 99, "worker_id": "w", "n": 1}), "bad_message"),
        (body("acquire", worker_id="w", n=-1), "bad_message"),
        (body("put", worker_id="w", groups=[{"id": "g", "samples": "no"}]), "bad_message"),
        (ack, "unexpected_kind"),  # a reply sent as a request
        (grant, "unexpected_kind"),
        (wire.encode(wire.Release(worker_id="w", lease_id="nope", starts=1)), "unknown_lease"),
        (wire.encode(wire.Put(worker_id="w", groups=[huge])), "bad_message"),  # over MAX_TOKENS
    ]


def test_bad_messages_get_errors_and_service_keeps_serving(service: BufferService) -> None:
    """10,000 bad requests on a raw nng socket, each answered with an Error; then a good one."""

    async def lease() -> str:
        async with BufferClient(service.address, worker_id="w") as c:
            return (await c.acquire(1)).lease_id

    lease_id = run(lease)
    bad = _bad_messages(lease_id)
    n = 10_000
    codes: dict[str, int] = {}
    failures: list[str] = []

    def blast() -> None:
        with pynng.Req0(dial=service.address, recv_timeout=20_000, send_timeout=20_000) as sock:
            for i in range(n):
                # The 4 MB one (last) only now and then: the test is about count, not bytes.
                data, code = bad[i % (len(bad) - 1)] if i % 1000 else bad[-1]
                sock.send(data)
                reply = wire.decode(sock.recv())
                if not (isinstance(reply, wire.Error) and reply.code == code):
                    failures.append(f"{i}: expected {code}, got {reply}")
                codes[code] = codes.get(code, 0) + 1

    t = threading.Thread(target=blast)
    t.start()
    t.join(100)
    assert not t.is_alive() and not failures, failures[:3]

    # A put for an unknown lease is a well-formed request: its Ack says why each group was refused.
    async def good() -> None:
        async with BufferClient(service.address, worker_id="w") as c:
            ack = await c.put([make_group("stray", "no-such-lease", versions=[0])])
            assert ack.rejected["stray"].startswith("unknown_lease:")
            ack = await c.put([make_group("ok", lease_id, versions=[0])])
            assert ack.group_ids == ["ok"]

    run(good)
    stats = service.stats()
    assert stats["bad_messages_total"] == n
    assert stats["bad_messages"]["unexpected_kind"] == codes["unexpected_kind"]
    assert stats["bad_messages"]["undecodable"] == codes["bad_message"]
    assert stats["rejected"] == {"unknown_lease": 1} and stats["occupancy"] == 1


def test_oversized_message_is_dropped_and_service_keeps_serving() -> None:
    """Past the byte limit nng drops a request before reading it (the sender times out); the
    service goes on answering."""
    with BufferService(config(), max_message_bytes=64 * 1024) as svc:

        async def go() -> None:
            async with BufferClient(svc.address, worker_id="w", timeout_s=10) as c:
                grant = await c.acquire(1)
                big = make_group("big", grant.lease_id, versions=[0], tokens=40_000)
                with pytest.raises(TransportTimeout):
                    await c.put([big], attempts=1, timeout_s=0.5)
                ack = await c.put([make_group("small", grant.lease_id, versions=[0])])
                assert ack.group_ids == ["small"]

        run(go)


def test_put_resends_until_the_service_is_up_and_resume_from_state() -> None:
    """A worker starts before the buffer (its first put times out, then it is resent with the same
    ids); later the learner restarts from saved state and serves each group exactly once."""
    address = free_tcp_address()
    cfg = config(address=address, groups_per_batch=2, max_staleness=1)
    first = BufferService(cfg).start()
    try:
        grant = run(_acquire, address, 4)
    finally:
        first.stop()
    state = first.state_dict()

    groups = [make_group(f"g{i}", grant.lease_id, versions=[0]) for i in range(3)]

    async def worker_first() -> None:
        async with BufferClient(address, worker_id="w") as c:
            with pytest.raises(TransportTimeout):  # nobody listening
                await c.put(groups[:2], attempts=2, timeout_s=0.2, backoff_s=0.01)

    run(worker_first)
    second = BufferService(cfg, state=json.loads(json.dumps(state))).start()
    try:
        acks = run(_put, address, groups[:2])
        assert acks.group_ids == ["g0", "g1"]
        batch = second.next_batch(timeout_s=10)
        assert [g.id for g in batch.groups] == ["g0", "g1"]
        second.set_version(1)
        saved = second.state_dict()
    finally:
        second.stop()

    third = BufferService(cfg, state=saved).start()
    try:
        acks = run(_put, address, groups)  # g0, g1 resent after the restart, g2 new
        assert acks.group_ids == ["g0", "g1", "g2"]
        assert third.stats()["occupancy"] == 1 and third.stats()["consumed"] == 2
        assert third.stats()["capacity"] == 2  # (1+1+1)*2 - (2 consumed + 1 stored + 1 in flight)
    finally:
        third.stop()


async def _acquire(address: str, n: int) -> wire.Grant:
    async with BufferClient(address, worker_id="w") as c:
        return await c.acquire(n)


async def _put(address: str, groups: list[wire.Group]) -> wire.Ack:
    async with BufferClient(address, worker_id="w") as c:
        return await c.put(groups, timeout_s=5)


def test_tls_from_the_recipe(tmp_path) -> None:
    """Remote use: tls+tcp:// addresses and the recipe's certificates, on both sockets."""
    ca = trustme.CA()
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem.bytes())
    paths = {}
    for name, ident in (("server", "127.0.0.1"), ("client", "worker.asyncrl")):
        cert = ca.issue_cert(ident)
        (tmp_path / f"{name}.crt").write_bytes(b"".join(p.bytes() for p in cert.cert_chain_pems))
        (tmp_path / f"{name}.key").write_bytes(cert.private_key_pem.bytes())
        paths[name] = TLS(
            cert=str(tmp_path / f"{name}.crt"),
            key=str(tmp_path / f"{name}.key"),
            ca=str(tmp_path / "ca.pem"),
        )
    s = paths["server"]
    cfg = config(
        address="tls+tcp://127.0.0.1:0",
        pub_address="tls+tcp://127.0.0.1:0",
        tls=TLSConfig(cert=s.cert, key=s.key, ca=s.ca),
    )
    with BufferService(cfg, announce_every_s=0.2) as svc:
        assert svc.address.startswith("tls+tcp://127.0.0.1:")

        async def worker() -> None:
            async with BufferClient(svc.address, worker_id="w", tls=paths["client"]) as c:
                assert (await c.acquire(1)).starts == 1
            with Subscriber(svc.pub_address, tls=paths["client"]) as sub:
                with trio.fail_after(20):
                    while not isinstance(msg := await sub.receive(timeout_s=5), wire.Version):
                        pass
                assert msg.version == 0

        run(worker)


def test_a_restarted_worker_resumes_its_prompts_from_the_learner_checkpoint() -> None:
    """docs/design.md §6: the data position is shared through the learner's checkpoint. Groups carry the
    worker's position; the buffer state (saved with the learner) keeps the newest; after a learner
    restart, a new worker with the same id loads it and serves exactly the prompts not yet done."""
    from asyncrl.rollout.main import load_data_state
    from asyncrl.rollout.prompts import PromptSource

    rows = [{"prompt": f"p{i}"} for i in range(10)]
    address = free_tcp_address()
    cfg = config(address=address, groups_per_batch=2, max_staleness=1)
    source = PromptSource(rows, shuffle=False)
    items = [source.take() for _ in range(4)]  # prompts 0..3 started; 0..2 delivered, 3 in flight
    for it in items[:3]:
        source.done(it.index)

    first = BufferService(cfg).start()
    try:
        grant = run(_acquire, address, 3)
        groups = []
        for i, it in enumerate(items[:3]):
            g = make_group(f"g{i}", grant.lease_id, versions=[0])
            g.prompt_index = it.index
            g.metadata = {"worker_id": "w"}
            g.data_state = source.state_dict()
            groups.append(g)
        assert run(_put, address, groups).group_ids == ["g0", "g1", "g2"]
        saved = json.loads(json.dumps(first.state_dict()))  # what the learner checkpoints
    finally:
        first.stop()

    second = BufferService(cfg, state=saved).start()  # the learner restarted from its checkpoint
    try:
        fresh = PromptSource(rows, shuffle=False)  # the worker restarted too

        async def resume() -> None:
            async with BufferClient(address, worker_id="w") as c:
                await load_data_state(c, fresh, "w", timeout_s=10)

        run(resume)
        served = [fresh.take().index for _ in range(3)]
        assert served == [
            3,
            4,
            5,
        ]  # the in-flight prompt again first, then new ones: no skip, no repeat
    finally:
        second.stop()


@contextlib.contextmanager
def http_server():
    """A real HTTP server on loopback that answers every GET (404: any answer means reachable)."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_first_register_of_a_generator_the_learner_cannot_reach_is_refused() -> None:
    """A worker's first (fresh) Register names a generator the learner cannot connect to: refused
    with a machine-readable code and a message naming the url, the cause and the key to set; the
    broadcaster never hears of it, and the learner's wait names the refusal. A later Register
    (after a learner restart) is taken whatever the network does then: cut off for a while is the
    broadcaster's business (dropped, taken back), not the end of the run."""
    from asyncrl.reach import unreachable

    calls: list[tuple[str, list[str]]] = []
    with (
        http_server() as up,
        refused_url() as down,  # held, not listening, for the whole test
        BufferService(config(), reach=unreachable) as svc,
    ):
        svc.on_register(lambda wid, gens: calls.append((wid, [g.url for g in gens])))

        async def go() -> None:
            gens = [wire.GeneratorInfo(url=up), wire.GeneratorInfo(url=down, kind="builtin")]
            async with BufferClient(svc.address, worker_id="w1") as c:
                with pytest.raises(BufferRefused) as refused:
                    await c.register(gens, fresh=True)
                assert refused.value.code == "generator_unreachable"
                text = str(refused.value)
                assert f"the learner cannot reach generator {down} (ConnectError:" in text
                assert "generator.host" in text and up not in text and "\n" not in text
                stats = (await c.status()).stats
                assert stats["workers_registered"] == 0 and not calls
                assert stats["registrations_refused"] == {"w1": text.split(": ", 1)[1]}
                with pytest.raises(TimeoutError, match=f"registrations refused: w1: .*{down}"):
                    await trio.to_thread.run_sync(svc.next_batch, 0.2)
                await c.register(gens)  # not fresh: taken, and the refusal forgotten
                assert calls == [("w1", [up, down])]
                assert (await c.status()).stats["registrations_refused"] == {}
            async with BufferClient(svc.address, worker_id="w2") as c:
                await c.register([wire.GeneratorInfo(url=up)], fresh=True)  # it answers: taken
            assert calls[-1] == ("w2", [up])

        run(go)


def test_the_wait_for_a_batch_names_what_the_learner_knows() -> None:
    """No worker registered, or every generator dropped by the broadcaster: the timeout (what the
    learner's one-line error and its waiting line say) names it."""
    with BufferService(config(), announce_every_s=0.2) as svc:
        with pytest.raises(TimeoutError, match="no worker registered with tcp://"):
            svc.next_batch(timeout_s=0.2)
        svc.watch_generators(lambda: {"http://10.0.0.9:30000": "preflight: unreachable"})
        assert svc.stats()["generators_dropped"] == {
            "http://10.0.0.9:30000": "preflight: unreachable"
        }
        cause = svc.waiting_cause()
        assert cause.startswith("at version 0 (0/2 groups stored")
        assert cause.endswith("no weights to http://10.0.0.9:30000 (preflight: unreachable)")


def test_the_learners_drift_sets_the_depth_a_worker_is_granted() -> None:
    """buffer.adaptive_depth_ess: the learner hands the service a step's metrics
    (``adapt_depth``, as learner/main.py does after each step) and a worker's next acquire over
    the real socket is granted that many batches ahead: 1 at the start, 2 after a calm step, 1
    again after a step whose ESS fell."""
    with BufferService(config(max_staleness=3, adaptive_depth_ess=0.9)) as svc:

        async def acquire(rid: str) -> int:
            async with BufferClient(svc.address, worker_id="w1") as c:
                grant = await c.acquire(8, request_id=rid)
                await c.release(grant.lease_id, grant.starts)  # give them back
                return grant.starts

        assert run(acquire, "a") == 2
        svc.adapt_depth({"loss/ess": 0.97, "loss/kl_mu_k3": 0.01})
        assert run(acquire, "b") == 4 and svc.stats()["depth"] == 2
        svc.adapt_depth({"loss/ess": 0.4})
        assert run(acquire, "c") == 2
