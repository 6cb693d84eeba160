"""Where the full path's time goes: the codec on each side against asyncrl's Req/Rep machinery.

Six phases, side by side, on the Puts and pinned processes of ``tools/bench/wire.py`` (trio,
``--in-flight`` requests outstanding):

- ``raw``: pre-encoded bytes over plain pynng, a server that answers pre-encoded Ack bytes;
- ``full``: ``ReqClient.request`` and ``RepServer``, encoding and decoding every Put;
- ``cached-encode``: the same, but the worker side hands over the bytes each Put encodes to (its
  encoding costs nothing); the buffer side still decodes every Put;
- ``cached-both``: the buffer side's decoding is replaced too (it returns the Put it decoded first),
  so what is left over ``raw`` is asyncrl's transport: contexts, timeouts, the Ack's codec;
- ``copy-only`` and ``copy-only-cached``: the worker side's encoding is cut to its one copy of the
  payload (the Put's own arrays joined after the header it encodes to, gathered beforehand), against
  the decoding buffer side and the cached one: the bound of an encoder that did nothing but copy.

Each phase also reports how busy each of the two cores was (from ``/proc/stat``): raw nng alone
keeps both near 100 %, so whatever the codec adds on a core adds to the time.

The replacements are measuring devices, not code paths asyncrl has. Each figure is the median over
``--repeat`` rounds; the last line is JSON.

Run: ``.venv/bin/python tools/bench/wire_breakdown.py [--messages 800] [--repeat 5]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from wire import (  # noqa: E402
    ack_for,
    bench_trio,
    make_puts,
    parse_options,
    server_process,
    setup_process,
)

from asyncrl import transport, wire  # noqa: E402


def core_times(cpus: list[int]) -> list[tuple[int, int]]:
    """(busy, total) jiffies of each CPU, from /proc/stat (empty where it cannot be read)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return []
    rows = {f[0]: list(map(int, f[1:])) for f in map(str.split, lines) if f[0][3:].isdigit()}
    out = []
    for c in cpus:
        v = rows.get(f"cpu{c}")
        if v is None:
            return []
        out.append((sum(v) - v[3] - v[4], sum(v)))  # idle and iowait are not busy
    return out


def busy(before: list[tuple[int, int]], after: list[tuple[int, int]]) -> list[float]:
    return [(b1 - b0) / max(1, t1 - t0) for (b0, t0), (b1, t1) in zip(before, after, strict=True)]


def _serve_cached(a: argparse.Namespace, out) -> None:
    """A RepServer whose decoding is replaced by the first Put it decoded."""
    setup_process(a, 1)
    first: list[wire.Message] = []
    decode = transport.decode_message

    def cached(m, expect=None):
        if not first:
            first.append(decode(m, expect))
        return first[0]

    transport.decode_message = cached

    async def main() -> None:
        server = transport.RepServer("tcp://127.0.0.1:0", concurrency=a.in_flight)
        out.put(server.listen())
        await server.serve(ack_for)

    trio.run(main)


def main() -> None:
    a = parse_options(__doc__, messages=800, repeat=5)

    puts = make_puts(4, a.groups, a.group_size)
    encoded = {id(m): wire.encode(m) for m in puts}
    parts = {}  # id(Put) -> (its header, its arrays in message order)
    for m in puts:
        samples = [s for g in m.groups for s in g.samples]
        pieces = [getattr(s, k) for k in wire.TOKEN_ARRAYS for s in samples]
        data = encoded[id(m)]
        parts[id(m)] = (data[: len(data) - sum(p.nbytes for p in pieces)], pieces)
    encode = wire.encode
    devices = {
        "cached": lambda m: encoded.get(id(m)) or encode(m),
        "copy": lambda m: (
            b"".join([parts[id(m)][0], *parts[id(m)][1]]) if id(m) in parts else encode(m)
        ),
    }
    cpus = a.cpus[:2] if a.pin else a.cpus

    def phase(address: str, *, full: bool, device: str | None) -> tuple[float, list[float]]:
        wire.encode = devices[device] if device else encode
        try:
            t0 = core_times(cpus)
            s = bench_trio(puts, a.messages, address, full=full, in_flight=a.in_flight)
            return s, busy(t0, core_times(cpus))
        finally:
            wire.encode = encode

    assert all(devices["copy"](m) == encoded[id(m)] for m in puts)  # the same bytes

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    cached_server = ctx.Process(target=_serve_cached, args=(a, out), daemon=True)
    cached_server.start()
    names = ("raw", "full", "cached-encode", "cached-both", "copy-only", "copy-only-cached")
    times: dict[str, list[float]] = {k: [] for k in names}
    loads: dict[str, list[list[float]]] = {k: [] for k in names}
    try:
        cached_address = out.get(timeout=120)
        with server_process("raw-trio", a) as raw, server_process("full-trio", a) as full:
            for _ in range(a.repeat + 1):  # the first round warms up and is not counted
                for name, address, is_full, device in (
                    ("raw", raw, False, None),
                    ("full", full, True, None),
                    ("cached-encode", full, True, "cached"),
                    ("cached-both", cached_address, True, "cached"),
                    ("copy-only", full, True, "copy"),
                    ("copy-only-cached", cached_address, True, "copy"),
                ):
                    s, load = phase(address, full=is_full, device=device)
                    times[name].append(s)
                    loads[name].append(load)
    finally:
        cached_server.terminate()
        cached_server.join(timeout=30)
    per_msg = {k: statistics.median(v[1:]) / a.messages * 1e6 for k, v in times.items()}
    core_busy = {  # median over the counted rounds, per core
        k: [statistics.median(r[c] for r in v[1:]) for c in range(len(v[0]))] if v[0] else []
        for k, v in loads.items()
    }
    for name, us in per_msg.items():
        cores = " ".join(f"{b:4.0%}" for b in core_busy[name])
        print(
            f"{name:<17} {us:6.0f} µs per Put   share over raw {1 - per_msg['raw'] / us:6.1%}"
            f"   cores busy {cores or 'n/a'}"
        )
    result = {
        "bench": "wire_breakdown",
        **{f"{k}_us": round(v, 1) for k, v in per_msg.items()},
        **{f"{k}_cores_busy": [round(b, 3) for b in v] for k, v in core_busy.items()},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
