"""Where the full path's time goes: the codec on each side against asyncrl's Req/Rep machinery.

Four phases, side by side, on the Puts and pinned processes of ``tools/bench/wire.py`` (trio,
``--in-flight`` requests outstanding):

- ``raw``: pre-encoded bytes over plain pynng, a server that answers pre-encoded Ack bytes;
- ``full``: ``ReqClient.request`` and ``RepServer``, encoding and decoding every Put;
- ``cached-encode``: the same, but the worker side hands over the bytes each Put encodes to (its
  encoding costs nothing); the buffer side still decodes every Put;
- ``cached-both``: the buffer side's decoding is replaced too (it returns the Put it decoded first),
  so what is left over ``raw`` is asyncrl's transport: contexts, timeouts, the Ack's codec.

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
    encode = wire.encode

    def phase(address: str, *, full: bool, cached: bool) -> float:
        wire.encode = (lambda m: encoded.get(id(m)) or encode(m)) if cached else encode
        try:
            return bench_trio(puts, a.messages, address, full=full, in_flight=a.in_flight)
        finally:
            wire.encode = encode

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    cached_server = ctx.Process(target=_serve_cached, args=(a, out), daemon=True)
    cached_server.start()
    times: dict[str, list[float]] = {k: [] for k in ("raw", "full", "cached-encode", "cached-both")}
    try:
        cached_address = out.get(timeout=120)
        with server_process("raw-trio", a) as raw, server_process("full-trio", a) as full:
            for _ in range(a.repeat + 1):  # the first round warms up and is not counted
                for name, address, is_full, cached in (
                    ("raw", raw, False, False),
                    ("full", full, True, False),
                    ("cached-encode", full, True, True),
                    ("cached-both", cached_address, True, True),
                ):
                    times[name].append(phase(address, full=is_full, cached=cached))
    finally:
        cached_server.terminate()
        cached_server.join(timeout=30)
    per_msg = {k: statistics.median(v[1:]) / a.messages * 1e6 for k, v in times.items()}
    for name, us in per_msg.items():
        print(f"{name:<14} {us:6.0f} µs per Put   share over raw {1 - per_msg['raw'] / us:6.1%}")
    result = {"bench": "wire_breakdown", **{f"{k}_us": round(v, 1) for k, v in per_msg.items()}}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
