"""Benchmark the buffer service: groups/s, MB/s and put latency, against raw nng Req/Rep.

    python tools/bench/buffer.py [--clients 3] [--groups 6000] [--put-batch 8] [--tokens 1024]

Side by side in one run, on loopback TCP:
1. buffer: ``--clients`` worker processes acquire starts and put groups (``--samples`` samples of
   ``--prompt`` + ``--tokens`` tokens each, ``--put-batch`` groups per Put message, each put waits
   for its Ack), while this process's learner thread drains batches from the BufferService and moves
   the version on after each, as a training loop would.
2. raw: the same number of processes send the same encoded Put bytes over a plain pynng Req/Rep pair
   whose server only answers a few bytes: the floor our service's cost is measured against.
The last line is JSON: {"bench": "buffer", "groups_per_s": ..., "raw_groups_per_s": ..., ...}.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pynng  # noqa: E402
import trio  # noqa: E402

from asyncrl import malloc, wire  # noqa: E402
from asyncrl.buffer.client import BufferClient  # noqa: E402
from asyncrl.buffer.service import BufferService  # noqa: E402
from asyncrl.recipe import BufferConfig  # noqa: E402

_TEMPLATE: dict = {}


def make_groups(
    worker: str, start: int, n: int, lease_id: str, version: int, args: argparse.Namespace
) -> list[wire.Group]:
    """Groups with fresh ids over the same arrays (made once): a worker's arrays come from its
    generator, so making them is not part of what is measured."""
    key = (args.prompt, args.tokens, version)
    if key not in _TEMPLATE:
        rng = np.random.default_rng(0)
        t = args.tokens
        _TEMPLATE[key] = {
            "prompt_ids": rng.integers(0, 150_000, args.prompt, dtype=np.int32),
            "completion_ids": rng.integers(0, 150_000, t, dtype=np.int32),
            "behavior_logprobs": -rng.random(t, dtype=np.float32),
            "versions": np.full(t, version, dtype=np.int32),
            "loss_mask": np.ones(t, dtype=np.float32),
        }
    arrays = _TEMPLATE[key]
    out = []
    for i in range(start, start + n):
        gid = f"{worker}-{i}"
        samples = [
            wire.Sample(id=f"{gid}/{j}", group_id=gid, reward=float(j % 2), **arrays)
            for j in range(args.samples)
        ]
        out.append(wire.Group(id=gid, lease_id=lease_id, samples=samples))
    return out


def group_bytes(args: argparse.Namespace) -> int:
    return len(wire.encode(make_groups("w0", 0, 1, "lease", 0, args)[0]))


def buffer_client(address: str, worker: str, n_groups: int, args, ready, go, results) -> None:
    """One worker process: acquire, build, put with ack, until ``n_groups`` are acknowledged."""
    _malloc(args)

    async def main() -> None:
        lat: list[float] = []
        sent_bytes = done = rejected = 0
        async with BufferClient(address, worker_id=worker, timeout_s=60) as c:
            await c.status()  # connected
            ready.set()
            go.wait()
            t0, c0 = time.perf_counter(), time.process_time()
            gb = group_bytes(args)
            while done < n_groups:
                # A worker asks for as many starts as it runs groups at once, and puts as they end.
                grant = await c.acquire(min(args.lease, n_groups - done))
                if grant.starts == 0:
                    await trio.sleep(0.002)  # at the bound: the learner has to catch up
                    continue
                for i in range(0, grant.starts, args.put_batch):
                    k = min(args.put_batch, grant.starts - i)
                    groups = make_groups(worker, done, k, grant.lease_id, grant.version, args)
                    t = time.perf_counter()
                    ack = await c.put(groups)
                    lat.append(time.perf_counter() - t)
                    # A group that finished too late for the bound is refused (the worker would
                    # have cancelled it on hearing the version); it still crossed the wire.
                    rejected += len(ack.rejected)
                    sent_bytes += k * gb
                    done += k
            results.put(
                {
                    "lat": lat,
                    "bytes": sent_bytes,
                    "s": time.perf_counter() - t0,
                    "cpu_s": time.process_time() - c0,
                    "rejected": rejected,
                }
            )

    trio.run(main)


def raw_client(address: str, worker: str, n_groups: int, args, ready, go, results) -> None:
    """The same bytes over a plain Req socket: encode once, send, wait for the reply."""
    _malloc(args)
    lat: list[float] = []
    sent_bytes = done = 0
    with pynng.Req0(dial=address, recv_timeout=60_000, send_timeout=60_000) as sock:
        ready.set()
        go.wait()
        t0, c0 = time.perf_counter(), time.process_time()
        while done < n_groups:
            k = min(args.put_batch, n_groups - done)
            groups = make_groups(worker, done, k, "raw", 0, args)
            data = wire.encode(wire.Put(worker_id=worker, groups=groups))
            sent_bytes += len(data)
            t = time.perf_counter()
            sock.send(data)
            sock.recv()
            lat.append(time.perf_counter() - t)
            done += k
    results.put(
        {
            "lat": lat,
            "bytes": sent_bytes,
            "s": time.perf_counter() - t0,
            "cpu_s": time.process_time() - c0,
        }
    )


def _malloc(args) -> None:
    """Every process of the bench, raw and ours alike, runs with asyncrl's malloc settings (as
    ``asyncrl`` sets them at start) unless ``--malloc-defaults``."""
    if not args.malloc_defaults:
        malloc.keep_freed_memory()


def run_clients(target, address: str, args) -> tuple[float, float, list[dict]]:
    """Start the client processes, release them together; returns wall seconds, this process's
    CPU seconds meanwhile (the server: service thread and learner thread), the clients' results."""
    ctx = mp.get_context("spawn")
    results, go = ctx.Queue(), ctx.Event()
    per = args.groups // args.clients
    procs, readies = [], []
    for i in range(args.clients):
        ready = ctx.Event()
        p = ctx.Process(target=target, args=(address, f"w{i}", per, args, ready, go, results))
        p.start()
        procs.append(p)
        readies.append(ready)
    for r in readies:
        if not r.wait(120):
            raise SystemExit("bench buffer: a client did not connect within 120 s")
    t0, c0 = time.perf_counter(), time.process_time()
    go.set()
    out = [results.get(timeout=600) for _ in procs]
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    for p in procs:
        p.join(30)
    return wall, cpu, out


def summary(
    name: str, wall: float, cpu: float, out: list[dict], groups: int, accepted: int | None = None
) -> dict:
    """Rates of accepted groups by the wall clock, and CPU per group sent, which a loaded machine
    does not distort."""
    lat = np.array([x for o in out for x in o["lat"]])
    mb = sum(o["bytes"] for o in out) / 1e6
    return {
        f"{name}server_cpu_us_per_group": cpu / groups * 1e6,
        f"{name}client_cpu_us_per_group": sum(o["cpu_s"] for o in out) / groups * 1e6,
        f"{name}groups_per_s": (groups if accepted is None else accepted) / wall,
        f"{name}mb_per_s": mb / wall,
        f"{name}put_p50_ms": float(np.percentile(lat, 50) * 1e3),
        f"{name}put_p99_ms": float(np.percentile(lat, 99) * 1e3),
        f"{name}seconds": wall,
    }


def bench_buffer(args) -> dict:
    cfg = BufferConfig(groups_per_batch=args.batch, max_staleness=args.eta, lease_seconds=120.0)
    svc = BufferService(cfg).start()
    total = args.groups // args.clients * args.clients
    batch_wait: list[float] = []
    clients_done = threading.Event()

    def learner() -> None:
        """Train on every full batch until the clients are done and none is left."""
        while True:
            try:
                batch = svc.next_batch(timeout_s=0.5)
            except TimeoutError:
                if clients_done.is_set():
                    return
                continue
            batch_wait.append(batch.stats["wait_s"])
            svc.set_version(svc.version + 1)

    t = threading.Thread(target=learner, name="learner")
    t.start()
    try:
        wall, cpu, out = run_clients(buffer_client, svc.address, args)
        clients_done.set()
        t.join(60)
        stats = svc.stats()
    finally:
        clients_done.set()
        svc.stop()
    rejected = sum(o["rejected"] for o in out)
    res = summary("", wall, cpu, out, total, total - rejected)
    res["rejected_groups"] = rejected
    res["staleness_max"] = stats["staleness_max"]
    # The first wait includes the clients' start-up; the rest is the learner starved of data.
    res["learner_wait_fraction"] = sum(batch_wait[1:]) / wall
    res["admission_waits"] = stats["admission_waits"]
    return res


def bench_raw(args) -> dict:
    total = args.groups // args.clients * args.clients
    sock = pynng.Rep0(listen="tcp://127.0.0.1:0", recv_max_size=wire.MAX_MESSAGE_BYTES)
    port = sock.listeners[0].local_address.port
    address = f"tcp://127.0.0.1:{__import__('socket').ntohs(port)}"
    stop = threading.Event()

    def serve() -> None:
        sock.recv_timeout = 200
        while not stop.is_set():
            try:
                sock.recv()
            except pynng.Timeout:
                continue
            sock.send(b"ok")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        wall, cpu, out = run_clients(raw_client, address, args)
    finally:
        stop.set()
        t.join(5)
        sock.close()
    return summary("raw_", wall, cpu, out, total)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--groups", type=int, default=6000)
    p.add_argument("--put-batch", type=int, default=8, help="groups per Put message")
    p.add_argument("--lease", type=int, default=32, help="starts asked for per Acquire")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=1024, help="completion tokens per sample")
    p.add_argument("--batch", type=int, default=64, help="groups_per_batch of the learner")
    p.add_argument("--eta", type=int, default=2, help="max_staleness")
    p.add_argument(
        "--malloc-defaults",
        action="store_true",
        help="keep glibc's malloc defaults (asyncrl.malloc explains what asyncrl changes)",
    )
    args = p.parse_args(argv)
    _malloc(args)
    gb = group_bytes(args)
    print(
        f"{args.clients} clients, {args.groups} groups of {args.samples} x "
        f"({args.prompt}+{args.tokens}) tokens = {gb / 1e3:.0f} kB, "
        f"{args.put_batch} groups per put; 2-core CPU, loopback TCP"
    )
    raw = bench_raw(args)
    print(
        f"raw nng Req/Rep: {raw['raw_groups_per_s']:8.0f} groups/s {raw['raw_mb_per_s']:7.0f} MB/s "
        f"put p50 {raw['raw_put_p50_ms']:.2f} ms p99 {raw['raw_put_p99_ms']:.2f} ms; CPU per group "
        f"server {raw['raw_server_cpu_us_per_group']:.0f} us, clients "
        f"{raw['raw_client_cpu_us_per_group']:.0f} us"
    )
    buf = bench_buffer(args)
    print(
        f"buffer service : {buf['groups_per_s']:8.0f} groups/s {buf['mb_per_s']:7.0f} MB/s "
        f"put p50 {buf['put_p50_ms']:.2f} ms p99 {buf['put_p99_ms']:.2f} ms "
        f"(learner waiting {buf['learner_wait_fraction']:.0%}, staleness max "
        f"{buf['staleness_max']}, {buf['rejected_groups']} groups refused as too late); CPU per "
        f"group server {buf['server_cpu_us_per_group']:.0f} us, clients "
        f"{buf['client_cpu_us_per_group']:.0f} us"
    )
    res = {
        "bench": "buffer",
        **buf,
        **raw,
        "ratio_vs_raw": buf["groups_per_s"] / raw["raw_groups_per_s"],
        # What one free core would sustain: the service is one thread, so its CPU per group is
        # its limit whatever else the machine runs.
        "server_core_groups_per_s": 1e6 / buf["server_cpu_us_per_group"],
        "load_average_1min": os.getloadavg()[0],
        "group_kb": gb / 1e3,
        "clients": args.clients,
        "put_batch": args.put_batch,
        "malloc": "glibc defaults" if args.malloc_defaults else "asyncrl.malloc",
    }
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
