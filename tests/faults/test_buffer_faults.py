"""Faults: the buffer service under hostile and broken input (docs/design.md §3: validate every field, unpickle nothing).

The service runs in its own process (``learner_stub.py``: the real BufferService, consuming batches)
behind mutual TLS. One authenticated attacker sends 12,000 malformed, mistyped, mis-sized, replayed
and out-of-order requests; strangers without the right certificate try to get in; a good worker
keeps acquiring and putting all the while. Every bad request is answered with an Error (and counted by
the service) or refused; the good worker is served throughout; the service never crashes; every group
acknowledged to the good worker is trained exactly once.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pynng
import pytest
from harness import FAULTS, Proc, exactly_once, lineage, read_jsonl, report, wait_until

from asyncrl import wire
from asyncrl.transport import TLS, ReqClient, TransportTimeout

pytestmark = pytest.mark.faults

N_FUZZ = 12_000
BOUND_S = 240.0  # the whole scenario


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, TLS]:
    """A CA, the service's and the worker's certificates, and an intruder signed by another CA."""
    import trustme

    d = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    out = {}
    for name, issuer, ident in (
        ("server", ca, "127.0.0.1"),
        ("client", ca, "worker"),
        ("intruder", other, "worker"),
    ):
        cert = issuer.issue_cert(ident)
        (d / f"{name}.crt").write_bytes(b"".join(p.bytes() for p in cert.cert_chain_pems))
        (d / f"{name}.key").write_bytes(cert.private_key_pem.bytes())
        (d / f"{name}-ca.pem").write_bytes(issuer.cert_pem.bytes())
        out[name] = TLS(
            cert=str(d / f"{name}.crt"), key=str(d / f"{name}.key"), ca=str(d / f"{name}-ca.pem")
        )
    return out


def sample(gid: str, i: int, version: int, tokens: int = 3) -> wire.Sample:
    return wire.Sample(
        id=f"{gid}/{i}",
        group_id=gid,
        prompt_ids=np.arange(2, dtype=np.int32),
        completion_ids=np.arange(tokens, dtype=np.int32) + 7,
        behavior_logprobs=np.full(tokens, -0.5, dtype=np.float32),
        versions=np.full(tokens, version, dtype=np.int32),
        loss_mask=np.ones(tokens, dtype=np.float32),
        reward=float(i),
    )


def group(gid: str, lease_id: str, version: int) -> wire.Group:
    return wire.Group(
        id=gid, lease_id=lease_id, samples=[sample(gid, i, version) for i in range(2)]
    )


def _plain(msg: wire.Message) -> dict:
    return msgpack.unpackb(wire.encode(msg), raw=False)


def fuzz_cases(rng: random.Random, n: int):
    """Yield (bytes, expect) for ``n`` bad requests; expect is an Error code, or "any" when a
    mutation may still be a well-formed request (then any valid reply will do)."""
    put = wire.encode(wire.Put(worker_id="evil", groups=[group("evil-g", "no-lease", 0)]))
    valid = [
        put,
        wire.encode(wire.Release(worker_id="evil", lease_id="no-lease", starts=1)),
        wire.encode(wire.Register(worker_id="evil", generators=[])),
        wire.encode(wire.Status()),
    ]
    replies = [
        wire.Ack(group_ids=["x"]),
        wire.Grant(lease_id="l", starts=1, version=0, lease_seconds=1.0),
        wire.Ok(version=0),
        wire.Error(code="x", message="y"),
        wire.StatusReply(version=0, stats={}),
        wire.Version(version=3),
    ]
    V = wire.SCHEMA_VERSION
    g = _plain(wire.Put(worker_id="w", groups=[group("g", "l", 0)]))
    cols = g["samples"]  # the message's sample columns: 2 samples of 3 completion tokens
    sizes = {  # bytes of each per-token array in ``tokens``, in order
        k: 4
        * sum(np.frombuffer(cols["prompt_len" if k == "prompt_ids" else "completion_len"], "<i4"))
        for k in ("prompt_ids", "completion_ids", "behavior_logprobs", "versions", "loss_mask")
    }
    ends = np.cumsum([0, *sizes.values()])
    sections = {k: g["tokens"][a:b] for k, a, b in zip(sizes, ends[:-1], ends[1:], strict=True)}

    def put_with(**fields) -> bytes:
        """The put with some sample columns or per-token arrays replaced."""
        arrays = {k: fields.pop(k, v) for k, v in sections.items()}
        tokens = (
            b"".join(arrays.values()) if all(type(v) is bytes for v in arrays.values()) else [1]
        )
        body = {**g, "samples": {**cols, **fields}, "tokens": tokens}
        return msgpack.packb(body, use_bin_type=True)

    assert isinstance(wire.decode(put_with()), wire.Put)  # valid as is: each case breaks one thing
    structured = [
        # wrong kinds: replies and non-request messages sent as requests
        *[(wire.encode(r), "unexpected_kind") for r in replies],
        (wire.encode(group("g", "l", 0)), "unexpected_kind"),
        (msgpack.packb({"kind": "steal_weights", "v": 1}), "bad_message"),
        (msgpack.packb({"kind": "acquire", "v": V + 1, "worker_id": "w", "n": 1}), "bad_message"),
        (msgpack.packb({"kind": "acquire", "v": V, "worker_id": 5, "n": 1}), "bad_message"),
        (msgpack.packb({"kind": "acquire", "v": V, "worker_id": "w", "n": -1}), "bad_message"),
        (msgpack.packb({"kind": "acquire", "v": V, "worker_id": "w", "n": 1 << 40}), "bad_message"),
        (msgpack.packb({"kind": "acquire", "v": V, "worker_id": "w", "n": "1"}), "bad_message"),
        (msgpack.packb({"kind": "acquire", "v": V, "worker_id": "w"}), "bad_message"),
        # wrong array lengths and values
        (put_with(versions=np.zeros(5, "<i4").tobytes()), "bad_message"),
        (put_with(behavior_logprobs=b"\x00" * 7), "bad_message"),
        (put_with(completion_ids=[7, 8, 9, 7, 8, 9]), "bad_message"),
        (put_with(completion_len=np.array([3, 4], "<i4").tobytes()), "bad_message"),
        (put_with(completion_len=np.array([-1, 7], "<i4").tobytes()), "bad_message"),
        (put_with(prompt_len=np.array([2], "<i4").tobytes()), "bad_message"),
        (put_with(id=["g/0"]), "bad_message"),
        (put_with(behavior_logprobs=np.full(6, np.nan, "<f4").tobytes()), "bad_message"),
        (put_with(behavior_logprobs=np.full(6, 2.0, "<f4").tobytes()), "bad_message"),
        (put_with(versions=np.full(6, -1, "<i4").tobytes()), "bad_message"),
        (put_with(loss_mask=np.full(6, 0.5, "<f4").tobytes()), "bad_message"),
        (put_with(finish_reason=["exploded", "stop"]), "bad_message"),
        (put_with(reward=np.array([np.inf, 0.0]).tobytes()), "bad_message"),
        (put_with(metadata=[{1: 2}, {}]), "bad_message"),
        (
            put_with(
                prompt_ids=np.zeros(2 * ((1 << 20) + 1), "<i4").tobytes(),
                prompt_len=np.array([(1 << 20) + 1] * 2, "<i4").tobytes(),
            ),
            "bad_message",
        ),
        # huge declared sizes in tiny messages
        (b"\xdb\xff\xff\xff\xf0abc", "bad_message"),  # str32 claiming 4 GB
        (b"\xc6\xff\xff\xff\xf0abc", "bad_message"),  # bin32 claiming 4 GB
        (b"\xdd\x7f\xff\xff\xff", "bad_message"),  # array32 claiming 2^31 items
        (b"\xdf\x7f\xff\xff\xff", "bad_message"),  # map32 claiming 2^31 pairs
        (b"\x91" * 200_000, "bad_message"),  # nested 200,000 deep
        (
            msgpack.packb({"kind": "put", "v": V, "worker_id": "w", "groups": [{}] * 70_000}),
            "bad_message",
        ),
        # not messages at all
        (b"", "bad_message"),
        (msgpack.packb([1, 2, 3]), "bad_message"),
        (msgpack.packb({"v": 1}), "bad_message"),
        (msgpack.packb({1: "put"}), "bad_message"),
        (b"\xd4\x01\x00", "bad_message"),  # an ext type
    ]
    for i in range(n):
        c = i % 4
        if c == 0:
            yield structured[(i // 4) % len(structured)]
        elif c == 1:
            yield bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64))), "bad_message"
        else:  # a valid request, mutated: bit flips, truncation or junk appended
            b = bytearray(rng.choice(valid))
            op = rng.randint(0, 2)
            if op == 0:
                for _ in range(rng.randint(1, 4)):
                    b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            elif op == 1:
                del b[rng.randrange(len(b)) :]
            else:
                b += bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 8)))
            yield bytes(b), "any"


class GoodWorker(threading.Thread):
    """A well-behaved worker: acquire, put groups of the granted version, record what was acked."""

    def __init__(self, address: str, tls: TLS) -> None:
        super().__init__(daemon=True)
        self.client = ReqClient(address, tls=tls, timeout_s=30)
        self.stop = threading.Event()
        self.acked: list[str] = []
        self.calls = 0
        self.errors: list[str] = []
        self.seq = 0

    def call(self, msg: wire.Message) -> wire.Message:
        reply = self.client.request_sync(msg)
        self.calls += 1
        return reply

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                grant = self.call(wire.Acquire(worker_id="good", starts=2))
                assert isinstance(grant, wire.Grant), grant
                if grant.starts == 0:
                    time.sleep(0.05)  # at the bound until the learner takes a batch
                    continue
                groups = []
                for _ in range(grant.starts):
                    self.seq += 1
                    groups.append(group(f"good-{self.seq}", grant.lease_id, grant.version))
                ack = self.call(wire.Put(worker_id="good", groups=groups))
                assert isinstance(ack, wire.Ack) and not ack.rejected, ack
                self.acked += ack.group_ids
                # A replay (a resend after a lost reply): acknowledged again and not stored twice,
                # or, once the learner moved past it, refused as stale (it was trained already).
                again = self.call(wire.Put(worker_id="good", groups=groups))
                assert isinstance(again, wire.Ack), again
                for gid in ack.group_ids:
                    assert gid in again.group_ids or again.rejected[gid].startswith("stale"), again
        except Exception as e:  # reported by the test
            self.errors.append(f"{type(e).__name__}: {e}")
        finally:
            self.client.close()


def test_malformed_flood_and_strangers_are_refused_and_good_clients_served(tmp_path: Path, pki):
    t_start = time.monotonic()
    out = tmp_path / "learner"
    cfg = {
        "address": "tls+tcp://127.0.0.1:0",
        "pub_address": "tls+tcp://127.0.0.1:0",
        "groups_per_batch": 2,
        "max_staleness": 1,
        "lease_seconds": 30,
    }
    s = pki["server"]
    learner = Proc(
        "learner_stub",
        [
            sys.executable,
            str(FAULTS / "learner_stub.py"),
            str(out),
            json.dumps(cfg),
            "--tls",
            f"{s.cert},{s.key},{s.ca}",
        ],
        tmp_path / "learner.log",
    ).start()
    try:
        wait_until(
            lambda: (out / "addresses.json").exists(),
            timeout_s=60,
            what="the buffer service to listen",
            procs=[learner],
        )
        address = json.loads((out / "addresses.json").read_text())["address"]
        good = GoodWorker(address, pki["client"])
        good.start()
        wait_until(
            lambda: good.acked or good.errors, timeout_s=60, what="a first ack", procs=[learner]
        )

        # 1. The flood, from a client with a valid certificate.
        rng = random.Random(0)
        errors: dict[str, int] = {}
        other_replies = 0
        calls_before = good.calls
        t0 = time.monotonic()
        with pynng.Req0(recv_timeout=30_000, send_timeout=30_000) as sock:
            sock.tls_config = pki["client"].client_config(address)
            sock.dial(address, block=True)
            for i, (data, expect) in enumerate(fuzz_cases(rng, N_FUZZ)):
                sock.send(data)
                reply = wire.decode(sock.recv())  # a reply always comes, and always decodes
                if isinstance(reply, wire.Error):
                    errors[reply.code] = errors.get(reply.code, 0) + 1
                    assert expect in ("any", reply.code), (i, data[:40], reply)
                else:
                    assert expect == "any", (i, data[:40], reply)
                    other_replies += 1
        flood_s = time.monotonic() - t0
        assert learner.alive(), learner.tail()
        assert good.calls > calls_before, "the good worker was not served during the flood"

        # 2. Strangers: no certificate, a certificate from another CA, plain tcp to the TLS port.
        refused = 0
        strangers = {
            "no_cert": pynng.TLSConfig(
                pynng.TLSConfig.MODE_CLIENT,
                server_name="127.0.0.1",
                ca_string=Path(pki["server"].ca).read_text(),
                auth_mode=pynng.TLSConfig.AUTH_MODE_REQUIRED,
            ),
            "intruder": pki["intruder"],
            "plain_tcp": None,
        }
        for who, tls in strangers.items():
            for _ in range(3):
                if who == "plain_tcp":
                    client = ReqClient(address.replace("tls+tcp", "tcp"), timeout_s=1.5)
                elif who == "intruder":
                    client = ReqClient(address, tls=tls, timeout_s=1.5)
                else:
                    client = None
                try:
                    if client is not None:
                        with pytest.raises(TransportTimeout):
                            client.request_sync(wire.Acquire(worker_id=who, starts=4))
                    else:
                        with pynng.Req0(recv_timeout=1500, send_timeout=1500) as raw:
                            raw.tls_config = tls
                            raw.dial(address, block=False)
                            with pytest.raises(pynng.Timeout):  # no session: send or recv waits
                                raw.send(wire.encode(wire.Acquire(worker_id=who, starts=4)))
                                raw.recv()
                finally:
                    if client is not None:
                        client.close()
                refused += 1
        calls_after_strangers = good.calls
        wait_until(
            lambda: good.calls > calls_after_strangers + 2 or good.errors,
            timeout_s=60,
            what="the good worker served after the strangers",
            procs=[learner],
        )

        # 3. Stop, and audit.
        good.stop.set()
        good.join(60)
        assert not good.errors, good.errors
        assert learner.stop() == 0, learner.tail()
        final = json.loads((out / "final.json").read_text())
        stats = final["stats"]
        bad = stats["bad_messages"]
        assert "internal" not in bad, bad  # the handler never raised on any input
        assert stats["bad_messages_total"] == sum(errors.values()), (bad, errors)
        assert bad.get("undecodable", 0) == errors.get("bad_message", 0)
        # every replay acknowledged without storing it again, or refused as stale once trained
        assert stats["duplicates"] + stats["rejected"].get("stale", 0) >= len(good.acked)
        trained = read_jsonl(out / "trained.jsonl")
        ids = [g["id"] for b in trained for g in b["groups"]]
        dropped = lineage(read_jsonl(out / "buffer" / "trained.jsonl"))[3]
        audit = exactly_once(good.acked, ids, final["stored"], dropped)
        assert audit["lost"] == 0 and audit["duplicated"] == 0, audit
        assert not any(i.startswith("evil") for i in ids + final["stored"])
        staleness = [b["version"] - g["min_version"] for b in trained for g in b["groups"]]
        assert max(staleness) <= cfg["max_staleness"]
        elapsed = time.monotonic() - t_start
        assert elapsed < BOUND_S
        record = {
            "scenario": "buffer: malformed flood + strangers",
            "bad_messages": N_FUZZ,
            "error_replies": sum(errors.values()),
            "error_codes": errors,
            "other_replies": other_replies,
            "flood_s": round(flood_s, 1),
            "strangers_refused": refused,
            "good_calls": good.calls,
            **audit,
            "staleness_max": max(staleness),
            "seconds": round(elapsed, 1),
        }
        report(record)
    finally:
        learner.stop()
