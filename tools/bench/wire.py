"""Wire + transport throughput: 1k-token samples over loopback nng, codec against raw bytes.

One run measures, side by side, on the same messages (Put of ``--groups`` x ``--group-size``
samples, each 200 prompt + 1,000 completion tokens with per-token logprobs, versions and mask),
with the client (a rollout worker) and the server (the learner's buffer) in two processes over
tcp://127.0.0.1:

- ``codec``: ``wire.encode`` + ``wire.decode`` alone, in a loop (no I/O);
- ``raw-thread`` / ``full-thread``: blocking pynng Req/Rep, one request at a time (the hot loop in
  a plain thread: the fastest way to drive pynng, measured before asyncrl was built). Raw moves the pre-encoded bytes and the
  server replies with pre-encoded ack bytes; full encodes each Put from its sample objects
  (``ReqClient.request_sync``) and the server decodes it (validating every field) and encodes an Ack;
- ``raw-trio`` / ``full-trio``: the same under trio with ``--in-flight`` requests outstanding; full
  uses asyncrl's own ``ReqClient.request`` and ``RepServer``;
- ``receive``: the server's CPU per Put, from arrival to decoded groups, one request at a time:
  copied out of nng's message into ``bytes`` first, against read in place (asyncrl's transport).

``codec_share`` = 1 - raw time / full time: the fraction of the full path's time that moving the
same bytes raw does not pay (encoding, decoding and validating, and the Python around them).
The four servers start once and are warmed up; then the phases run back to back for ``--repeat``
rounds, and each figure is the median over rounds of the paired (same round) ratio, since the
machine is shared and one phase is a fraction of a second. The worker side runs on one core and
the buffer side on the other (``--no-pin`` to let the OS place them), all processes with asyncrl's
malloc settings (``--malloc-defaults`` for glibc's).

Run: ``.venv/bin/python tools/bench/wire.py [--messages 500] [--repeat 7]``. The last line is JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import socket
import statistics
import time

import numpy as np
import pynng
import trio

from asyncrl import malloc, wire
from asyncrl.transport import RepServer, ReqClient, decode_message

PROMPT_TOKENS = 200
COMPLETION_TOKENS = 1000


def make_puts(n_distinct: int, groups: int, group_size: int, seed: int = 0) -> list[wire.Put]:
    """A few distinct Put messages; the runs cycle through them (the codec cost is the same)."""
    rng = np.random.default_rng(seed)
    puts = []
    for m in range(n_distinct):
        gs = []
        for g in range(groups):
            gid = f"m{m}-g{g}"
            samples = [
                wire.Sample(
                    id=f"{gid}-s{s}",
                    group_id=gid,
                    prompt_ids=rng.integers(0, 150_000, PROMPT_TOKENS, dtype=np.int32),
                    completion_ids=rng.integers(0, 150_000, COMPLETION_TOKENS, dtype=np.int32),
                    behavior_logprobs=-rng.exponential(1.0, COMPLETION_TOKENS).astype(np.float32),
                    versions=np.full(COMPLETION_TOKENS, 3, dtype=np.int32),
                    loss_mask=np.ones(COMPLETION_TOKENS, dtype=np.float32),
                    reward=float(s % 2),
                    metadata={"task": "gsm8k"},
                )
                for s in range(group_size)
            ]
            gs.append(wire.Group(id=gid, lease_id="lease", samples=samples, prompt_index=g))
        puts.append(wire.Put(worker_id="bench", groups=gs))
    return puts


def ack_for(put: wire.Put) -> wire.Ack:
    return wire.Ack(group_ids=[g.id for g in put.groups], version=3)


def bench_codec(puts: list[wire.Put], n: int) -> dict[str, float]:
    enc = dec = 0.0
    for i in range(n):
        t0 = time.perf_counter()
        data = wire.encode(puts[i % len(puts)])
        t1 = time.perf_counter()
        wire.decode(data)
        t2 = time.perf_counter()
        enc += t1 - t0
        dec += t2 - t1
    return {"encode_s_per_msg": enc / n, "decode_s_per_msg": dec / n}


MODES = ("raw-thread", "full-thread", "raw-trio", "full-trio")


def _serve(mode: str, a: argparse.Namespace, out) -> None:
    """The learner's side, in its own process: answer Puts until terminated.

    raw: reply with pre-encoded ack bytes, never looking at the request; full: decode the Put
    (validating every field, reading it in place from nng's message as asyncrl's transport does) and
    encode an Ack, through asyncrl's RepServer under trio.
    """
    setup_process(a, 1)
    kind, loop = mode.split("-")
    ack = wire.encode(ack_for(make_puts(1, a.groups, a.group_size)[0]))
    if loop == "thread":
        rep = pynng.Rep0()
        out.put(_bound(rep.listen("tcp://127.0.0.1:0")))
        while True:
            if kind == "raw":
                data = rep.recv()  # noqa: F841 - held like the full server holds its message
                rep.send(ack)
            else:
                msg = decode_message(rep.recv_msg())
                rep.send(wire.encode(ack_for(msg)))

    async def main() -> None:
        if kind == "full":
            server = RepServer("tcp://127.0.0.1:0", concurrency=a.in_flight)
            out.put(server.listen())
            await server.serve(ack_for)
            return
        rep = pynng.Rep0()
        out.put(_bound(rep.listen("tcp://127.0.0.1:0")))

        async def worker() -> None:
            ctx = rep.new_context()
            while True:
                await ctx.arecv()
                await ctx.asend(ack)

        async with trio.open_nursery() as nursery:
            for _ in range(a.in_flight):
                nursery.start_soon(worker)

    trio.run(main)


def _serve_receive(in_place: bool, n: int, a: argparse.Namespace, out) -> None:
    """A blocking Rep server that reports its CPU time per received Put, from the message's arrival
    to its decoded groups: copied out of nng's message first, or read in place (asyncrl's way)."""
    setup_process(a, 1)
    rep = pynng.Rep0()
    out.put(_bound(rep.listen("tcp://127.0.0.1:0")))
    cpu, kept = [], None
    while len(cpu) < n:
        m = rep.recv_msg()
        t0 = time.thread_time()
        kept = decode_message(m) if in_place else wire.decode(m.bytes)
        del m
        cpu.append(time.thread_time() - t0)
        rep.send(wire.encode(ack_for(kept)))
    out.put(statistics.mean(cpu[n // 10 :]))  # past the warm-up


def bench_receive(puts: list[wire.Put], n: int, a: argparse.Namespace) -> dict[str, float]:
    """Server CPU per received Put, one request at a time: copy-then-decode against in place."""
    encoded = [wire.encode(p) for p in puts]
    ctx = mp.get_context("spawn")
    result = {}
    for name, in_place in (("copy", False), ("in_place", True)):
        out = ctx.Queue()
        proc = ctx.Process(target=_serve_receive, args=(in_place, n, a, out), daemon=True)
        proc.start()
        try:
            with pynng.Req0(dial=out.get(timeout=120), recv_timeout=60_000) as req:
                for i in range(n):
                    req.send(encoded[i % len(encoded)])
                    req.recv()
            result[name] = out.get(timeout=60)
        finally:
            proc.terminate()
            proc.join(timeout=30)
    return result


def setup_process(a: argparse.Namespace, cpu: int) -> None:
    """Every process of the bench, raw and ours alike: asyncrl's malloc settings (as ``asyncrl``
    sets them at start) unless ``--malloc-defaults``; and its own core (the worker side on CPU 0,
    the buffer side on CPU 1, nng's threads with them) unless ``--no-pin``. Unpinned, the same code
    measured codec_share 0.10-0.39 from run to run as the scheduler moved the threads around."""
    if not a.malloc_defaults:
        malloc.keep_freed_memory()
    if a.pin and len(a.cpus) >= 2:
        os.sched_setaffinity(0, {a.cpus[cpu]})


def _bound(listener: pynng.Listener) -> str:
    return f"tcp://127.0.0.1:{socket.ntohs(listener.local_address.port)}"


@contextlib.contextmanager
def server_process(mode: str, a: argparse.Namespace):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_serve, args=(mode, a, out), daemon=True)
    proc.start()
    try:
        yield out.get(timeout=120)
    finally:
        proc.terminate()
        proc.join(timeout=30)


def bench_thread(puts: list[wire.Put], n: int, address: str, *, full: bool) -> float:
    """Seconds for n request/reply round trips with blocking pynng, one at a time."""
    encoded = [wire.encode(p) for p in puts]
    if full:
        with ReqClient(address, timeout_s=60) as client:
            client.request_sync(puts[0])  # warm-up: connection up
            t0 = time.perf_counter()
            for i in range(n):
                client.request_sync(puts[i % len(puts)], expect=wire.Ack)
            return time.perf_counter() - t0
    with pynng.Req0(dial=address, recv_timeout=60_000, send_timeout=60_000) as req:
        req.send(encoded[0])
        req.recv()
        t0 = time.perf_counter()
        for i in range(n):
            req.send(encoded[i % len(encoded)])
            req.recv()
        return time.perf_counter() - t0


def bench_trio(puts: list[wire.Put], n: int, address: str, *, full: bool, in_flight: int) -> float:
    """Seconds for n request/reply round trips under trio, ``in_flight`` at a time."""
    encoded = [wire.encode(p) for p in puts]
    per_task = [n // in_flight + (1 if k < n % in_flight else 0) for k in range(in_flight)]

    async def main() -> float:
        client = ReqClient(address, timeout_s=60)
        raw = pynng.Req0(dial=address)

        async def one(i: int) -> None:
            if full:
                await client.request(puts[i % len(puts)], expect=wire.Ack)
                return
            ctx = raw.new_context()
            try:
                await ctx.asend(encoded[i % len(encoded)])
                await ctx.arecv()
            finally:
                ctx.close()

        async def task(k: int) -> None:
            for j in range(per_task[k]):
                await one(k + j * in_flight)

        try:
            with trio.fail_after(300):
                await one(0)  # warm-up: connection up
                t0 = time.perf_counter()
                async with trio.open_nursery() as nursery:
                    for k in range(in_flight):
                        nursery.start_soon(task, k)
                return time.perf_counter() - t0
        finally:
            client.close()
            raw.close()

    return trio.run(main)


def parse_options(doc: str, *, messages: int, repeat: int) -> argparse.Namespace:
    """The options of this bench and of ``wire_breakdown.py``; sets this process up (CPU 0)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--messages", type=int, default=messages, help="Put messages per phase")
    p.add_argument("--groups", type=int, default=4, help="groups per Put")
    p.add_argument("--group-size", type=int, default=8, help="samples per group")
    p.add_argument("--in-flight", type=int, default=4, help="outstanding requests under trio")
    p.add_argument("--repeat", type=int, default=repeat, help="rounds of all phases (medians)")
    p.add_argument(
        "--malloc-defaults",
        action="store_true",
        help="keep glibc's malloc defaults (asyncrl.malloc explains what asyncrl changes)",
    )
    p.add_argument("--no-pin", dest="pin", action="store_false", help="let the OS place processes")
    a = p.parse_args()
    a.cpus = sorted(os.sched_getaffinity(0))  # before this process is pinned: its children inherit
    setup_process(a, 0)
    return a


def main() -> None:
    a = parse_options(__doc__, messages=500, repeat=7)

    puts = make_puts(4, a.groups, a.group_size)
    spm = a.groups * a.group_size
    msg_bytes = len(wire.encode(puts[0]))
    n = a.messages
    print(
        f"{n} Put messages x {spm} samples ({PROMPT_TOKENS} prompt + {COMPLETION_TOKENS} completion "
        f"tokens each), {msg_bytes / 1e6:.2f} MB per message, tcp://127.0.0.1"
    )
    codec = {"encode_s_per_msg": float("inf"), "decode_s_per_msg": float("inf")}
    times: dict[str, list[float]] = {m: [] for m in MODES}

    def phase(name: str, address: str, count: int) -> float:
        kind, loop = name.split("-")
        if loop == "thread":
            return bench_thread(puts, count, address, full=kind == "full")
        return bench_trio(puts, count, address, full=kind == "full", in_flight=a.in_flight)

    with contextlib.ExitStack() as stack:
        addresses = {m: stack.enter_context(server_process(m, a)) for m in MODES}
        for m in MODES:  # warm-up: connections, allocator and caches in a steady state
            phase(m, addresses[m], max(20, n // 5))
        for _ in range(a.repeat):
            c = bench_codec(puts, n)
            codec = {k: min(codec[k], c[k]) for k in codec}
            for m in MODES:
                times[m].append(phase(m, addresses[m], n))
    codec_s = codec["encode_s_per_msg"] + codec["decode_s_per_msg"]
    rounds = [bench_receive(puts, max(200, 2 * n), a) for _ in range(3)]
    receive = {k: statistics.median(r[k] for r in rounds) for k in ("copy", "in_place")}
    receive["ratio"] = statistics.median(r["in_place"] / r["copy"] for r in rounds)

    def share(loop: str) -> float:
        """Median over rounds of 1 - raw / full, each pair measured back to back."""
        pairs = zip(times[f"raw-{loop}"], times[f"full-{loop}"], strict=True)
        return statistics.median(1 - r / f for r, f in pairs)

    def rate(name: str) -> tuple[float, float]:
        s = statistics.median(times[name])
        return n * spm / s, n * msg_bytes / s / 1e6

    print(
        f"{'codec only':<12} {spm / codec_s:>10,.0f} samples/s {msg_bytes / codec_s / 1e6:>8.0f} MB/s"
        f"   (encode {codec['encode_s_per_msg'] * 1e3:.2f} ms, decode "
        f"{codec['decode_s_per_msg'] * 1e3:.2f} ms per message)"
    )
    for name in times:
        sps, mbs = rate(name)
        extra = ""
        if name.startswith("full"):
            extra = f"   codec_share {share(name[5:]):.0%} (median of {a.repeat} paired rounds)"
        print(f"{name:<12} {sps:>10,.0f} samples/s {mbs:>8.0f} MB/s{extra}")

    print(
        f"{'receive':<12} server CPU per Put, arrival to decoded: copied out of nng "
        f"{receive['copy'] * 1e6:.0f} µs, read in place {receive['in_place'] * 1e6:.0f} µs "
        f"(ratio {receive['ratio']:.2f}, median of 3 paired rounds)"
    )
    result = {
        "bench": "wire",
        "samples_per_message": spm,
        "message_mb": round(msg_bytes / 1e6, 3),
        "samples_per_s": round(rate("full-trio")[0]),
        "mb_per_s": round(rate("full-trio")[1], 1),
        "codec_share": round(share("trio"), 3),
        "raw_nng_mb_per_s": round(rate("raw-trio")[1], 1),
        "thread_samples_per_s": round(rate("full-thread")[0]),
        "thread_codec_share": round(share("thread"), 3),
        "raw_nng_thread_mb_per_s": round(rate("raw-thread")[1], 1),
        "codec_only_samples_per_s": round(spm / codec_s),
        "encode_ms_per_msg": round(codec["encode_s_per_msg"] * 1e3, 3),
        "decode_ms_per_msg": round(codec["decode_s_per_msg"] * 1e3, 3),
        "receive_cpu_us_copy": round(receive["copy"] * 1e6, 1),
        "receive_cpu_us_in_place": round(receive["in_place"] * 1e6, 1),
        "receive_in_place_ratio": round(receive["ratio"], 3),
        "malloc": "glibc defaults" if a.malloc_defaults else "asyncrl.malloc",
        "pinned": a.pin,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
