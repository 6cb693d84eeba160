"""Weight broadcast: the broadcaster against one raw broadcast, and the learner's step with overlap.

One run, on loopback gloo, with a random HF Qwen3 of about 100M parameters built locally (char
tokenizer, so almost all bytes are transformer blocks):

- ``raw``: rank 0 and a plain receiver process in one gloo group; one ``torch.distributed.broadcast``
  of a single flat uint8 tensor holding the model's bytes (the receiver allocates it fresh each
  time, as every real receiver does, and runs at nice 10, as the engine's receiver thread does).
- ``broadcaster``: :class:`asyncrl.weights.broadcaster.WeightBroadcaster` to a real built-in engine
  (``asyncrl engine``), ``overlap: false``, timed as the wall time of ``publish()``: the snapshot
  into buckets, preflight, session, buckets posted over HTTP concurrently with the broadcasts, the
  engine's staged receive and swap (verification off: it is timed once on its own, ``verify_s``).
  Both load formats; ``bandwidth_ratio`` = median over rounds of raw seconds / broadcaster seconds
  (measured back to back, so a load swing hits both) for the recipe default
  (``weights.load_format``, ``weights.bucket_mb``) (target >= 0.8).
- ``overlap``: a learner step is a fixed single-threaded compute (calibrated to ~2x the sync time)
  followed by ``on_step``-style publishing of fresh HF tensors. Steps are timed with no publishing
  (``base``), with ``overlap: false`` and with ``overlap: true``.
  ``overlap_step_ratio`` = median over rounds of (overlap-on step - base step, measured back to
  back) / sync seconds (target < 0.1).
Phases alternate for ``--repeat`` rounds (the machine is shared); times printed are the best.

``--ipc`` measures instead the two ways to an engine on rank 0's own device, side by side: a
broadcaster over gloo and one by handle (``weights.backend: ipc``; on the CPU the handles name
shared memory), each to an engine of its own, ``load_format: flattened_bucket``, verification off,
alternating versions for ``--repeat`` rounds. Printed: each one's sync seconds (best and median)
and ``ipc_speedup`` = median over rounds of gloo seconds / ipc seconds (back to back).

    .venv/bin/python tools/bench/weights.py [--hidden 768 --layers 14] [--repeat 5] [--bucket-mb 512]
    .venv/bin/python tools/bench/weights.py --ipc [--repeat 5]

The last line is JSON: {"bench": "weights", "bandwidth_ratio": ..., "overlap_step_ratio": ...}
(with ``--ipc``: {"bench": "weights_ipc", "gloo_sync_s": ..., "ipc_sync_s": ..., ...}).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from asyncrl import wire  # noqa: E402
from asyncrl.recipe import WeightsConfig  # noqa: E402
from asyncrl.transport import free_port  # noqa: E402
from asyncrl.weights import rendezvous  # noqa: E402
from asyncrl.weights.broadcaster import WeightBroadcaster  # noqa: E402


def _raw_receiver(port: int, nbytes: int, rounds: int, nice: int) -> None:
    torch.set_num_threads(1)
    os.setpriority(os.PRIO_PROCESS, 0, nice)  # before the group: its gloo threads inherit it
    pg = rendezvous.init_custom_process_group(
        master_address="127.0.0.1", master_port=port, rank=1, world_size=2, group_name="raw"
    )
    for _ in range(rounds):  # a fresh buffer each time, as every real receiver allocates one
        dist.broadcast(torch.empty(nbytes, dtype=torch.uint8), src=0, group=pg)
    rendezvous.destroy_process_group(pg)  # else gloo's threads abort the exit


class RawPeer:
    """A plain process in a 2-rank gloo group that receives ``rounds`` flat broadcasts."""

    def __init__(self, nbytes: int, rounds: int, nice: int):
        port = free_port("127.0.0.1")
        ctx = mp.get_context("spawn")
        self.proc = ctx.Process(
            target=_raw_receiver, args=(port, nbytes, rounds, nice), daemon=True
        )
        self.proc.start()
        self.pg = rendezvous.init_custom_process_group(
            master_address="127.0.0.1", master_port=port, rank=0, world_size=2, group_name="raw"
        )
        self.buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)

    def once(self) -> float:
        t0 = time.perf_counter()
        dist.broadcast(self.buf, src=0, group=self.pg)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.proc.join(60)
        rendezvous.destroy_process_group(self.pg)


def make_model(out: Path, hidden: int, layers: int) -> tuple[Path, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    from tools.make_tiny_model import make_tiny_model

    path = make_tiny_model(
        out,
        arch="qwen3",
        hidden=hidden,
        layers=layers,
        heads=hidden // 64,
        kv_heads=hidden // 64,
        intermediate=int(hidden * 8 / 3) // 64 * 64,
        tie_embeddings=True,
    )
    return path, load_file(str(path / "model.safetensors"))


def calibrate(target_s: float) -> int:
    """Iterations of the fake learner compute that take about ``target_s`` seconds when the machine
    is quiet (the fastest of several samples), so that under load a step is longer, never shorter."""
    a = torch.randn(384, 384)
    per = float("inf")
    for _ in range(8):
        t0 = time.perf_counter()
        for _ in range(10):
            a = torch.tanh(a @ a)
        per = min(per, (time.perf_counter() - t0) / 10)
    return max(1, int(target_s / per))


def compute(iters: int) -> None:
    a = torch.randn(384, 384)
    for _ in range(iters):
        a = torch.tanh(a @ a)


def timed_steps(b: WeightBroadcaster | None, named, iters: int, steps: int, v0: int) -> float:
    """Mean learner step time (compute, then publish fresh HF tensors) over steps 2..n: from the
    second step on, the previous version's broadcast runs during the compute."""
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        compute(iters)
        if b is not None:
            b.publish(v0 + i, dict(named), owned=True)  # hf_state_dict() hands over fresh copies
        times.append(time.perf_counter() - t0)
    if b is not None:
        b.wait()
    return sum(times[1:]) / len(times[1:])


def publish_once(b: WeightBroadcaster, version: int, named) -> tuple[float, float]:
    """(wall seconds of publish() with overlap off: snapshot + sync, sync seconds)."""
    t0 = time.perf_counter()
    b.publish(version, named, owned=True)
    wall = time.perf_counter() - t0
    r = b.reports[-1]
    assert not r.error and len(r.updated) == 1, r
    return wall, r.sync_s


def compare_ipc(model_dir: Path, named, a: argparse.Namespace, nbytes: int) -> None:
    """gloo against handles (``--ipc``), an engine each, alternating versions."""
    from concurrent.futures import ThreadPoolExecutor

    from asyncrl.engine import start_engine_process

    with ThreadPoolExecutor(2) as pool:
        engines = list(
            pool.map(
                lambda _: start_engine_process(model_dir, weight_version="0", timeout_s=300),
                range(2),
            )
        )
    backends = ("gloo", "ipc")
    bs = {}
    sync: dict[str, list[float]] = {k: [] for k in backends}
    snap: dict[str, list[float]] = {k: [] for k in backends}
    try:
        for backend, engine in zip(backends, engines, strict=True):
            cfg = WeightsConfig(
                backend=backend,
                bucket_mb=a.bucket_mb,
                timeout_s=120.0,
                overlap=False,
                load_format="flattened_bucket",
            )
            bs[backend] = WeightBroadcaster(cfg, rank=0, verify=False)
            bs[backend].add_generator(wire.GeneratorInfo(url=engine.url, kind="builtin"))
            publish_once(bs[backend], 1, named)  # warm-up: the group, first-touch page faults
        for r in range(a.repeat):
            for backend in backends if r % 2 == 0 else backends[::-1]:
                b = bs[backend]
                publish_once(b, r + 2, named)
                assert b.groups.backend(b.reports[-1].updated[0]) == backend
                sync[backend].append(b.reports[-1].sync_s)
                snap[backend].append(b.reports[-1].snapshot_s)
        # the last version checked on both sides: what each engine holds is what was sent
        for backend in backends:
            bs[backend].sync.verifies = True
            publish_once(bs[backend], a.repeat + 2, named)
            r = bs[backend].reports[-1]
            assert set(r.checksum_ok.values()) == {True}, r
    finally:
        for b in bs.values():
            b.close()
        for e in engines:
            e.stop()
    speedup = statistics.median(g / i for g, i in zip(sync["gloo"], sync["ipc"], strict=True))
    for backend in backends:
        best, med = min(sync[backend]), statistics.median(sync[backend])
        print(
            f"{backend:4s} sync best {best:7.3f} s  median {med:7.3f} s  "
            f"{nbytes / best / 1e9:5.2f} GB/s  (snapshot {statistics.median(snap[backend]):.3f} s)"
        )
    print(f"ipc speedup (median of {a.repeat} back-to-back gloo/ipc pairs) {speedup:.2f}x")
    print(
        json.dumps(
            {
                "bench": "weights_ipc",
                "bytes": nbytes,
                "bucket_mb": a.bucket_mb,
                **{f"{k}_sync_s": round(min(v), 3) for k, v in sync.items()},
                **{f"{k}_sync_median_s": round(statistics.median(v), 3) for k, v in sync.items()},
                "ipc_speedup": round(speedup, 2),
            }
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=14)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="learner steps per overlap phase")
    p.add_argument("--bucket-mb", type=float, default=WeightsConfig().bucket_mb)
    p.add_argument(
        "--raw-nice",
        type=int,
        default=10,
        help="niceness of the raw receiver: 10 = the built-in engine's weight-receiver thread",
    )
    p.add_argument(
        "--ipc",
        action="store_true",
        help="gloo against handles (weights.backend ipc), side by side",
    )
    a = p.parse_args()
    torch.set_num_threads(1)
    from asyncrl.engine import start_engine_process

    tmp = tempfile.TemporaryDirectory(prefix="bench-weights-")
    model_dir, named = make_model(Path(tmp.name) / "model", a.hidden, a.layers)
    params = sum(t.numel() for t in named.values())
    nbytes = sum(t.numel() * t.element_size() for t in named.values())
    print(f"model: {params / 1e6:.1f}M parameters, {nbytes / 2**20:.0f} MiB (float32)", flush=True)
    if a.ipc:
        try:
            compare_ipc(model_dir, named, a, nbytes)
        finally:
            tmp.cleanup()
        return

    engine = start_engine_process(model_dir, weight_version="0", timeout_s=300)
    raw = RawPeer(nbytes, rounds=a.repeat + 1, nice=a.raw_nice)
    formats = ("flattened_bucket", "list")
    cfg = WeightsConfig(bucket_mb=a.bucket_mb, timeout_s=120.0, overlap=False)
    b = WeightBroadcaster(cfg, verify=False)
    b.add_generator(wire.GeneratorInfo(url=engine.url, kind="builtin"))
    version = 0
    best = {k: float("inf") for k in ("raw", *formats, *(f"{f}_sync" for f in formats))}
    try:
        raw.once()  # warm-up: first-touch page faults on both sides
        version += 1
        publish_once(b, version, named)  # warm-up: builds the group
        ratios: dict[str, list[float]] = {f: [] for f in formats}
        for _ in range(a.repeat):  # alternate the phases: the machine is shared
            raw_r = raw.once()
            best["raw"] = min(best["raw"], raw_r)
            for f in formats:
                cfg.load_format = f
                version += 1
                wall, sync = publish_once(b, version, named)
                best[f] = min(best[f], wall)
                best[f"{f}_sync"] = min(best[f"{f}_sync"], sync)
                ratios[f].append(raw_r / wall)  # paired: measured back to back
        cfg.load_format = default = WeightsConfig().load_format
        raw.close()
        b.sync.verifies = True  # verification cost: checksums on both sides, after the update
        version += 1
        t0 = time.perf_counter()
        b.publish(version, named, owned=True)
        vr = b.reports[-1]
        verify_s = time.perf_counter() - t0 - vr.sync_s - vr.snapshot_s
        assert vr.checksum_ok == {engine.url: True}, vr
        b.sync.verifies = False
        ratio = {f: statistics.median(v) for f, v in ratios.items()}
        bw_ratio = ratio[default]
        gbps = {k: nbytes / v / 1e9 for k, v in best.items()}
        print(f"raw broadcast (one flat tensor)   {best['raw']:7.3f} s  {gbps['raw']:5.2f} GB/s")
        for f in formats:
            print(
                f"broadcaster {f:17s}     {best[f]:7.3f} s  {gbps[f]:5.2f} GB/s"
                f"  (transfer alone {best[f + '_sync']:.3f} s; bucket {a.bucket_mb:g} MiB)"
            )
        print(
            f"bandwidth ratio ({default}, the default) {bw_ratio:.3f}; flattened_bucket "
            f"{ratio['flattened_bucket']:.3f} (medians of {a.repeat} back-to-back pairs)"
        )
        print(f"verify (both checksums)           {verify_s:7.3f} s (not in the figures above)")

        b.close()  # the overlap phase uses a broadcaster built with overlap on (lower priority)
        b = WeightBroadcaster(WeightsConfig(bucket_mb=a.bucket_mb, timeout_s=120.0), verify=False)
        b.add_generator(wire.GeneratorInfo(url=engine.url, kind="builtin"))
        version += 1
        b.publish(version, named, owned=True)
        b.wait()
        sync_s = best[default]
        iters = calibrate(2.0 * sync_s)
        rounds = []  # (base, off, on) per round; the phases of a round are adjacent in time
        for _ in range(a.repeat):
            base_r = timed_steps(None, named, iters, a.steps, 0)
            b.cfg.overlap = False
            off_r = timed_steps(b, named, iters, a.steps, version + 1)
            version += a.steps
            b.cfg.overlap = True
            on_r = timed_steps(b, named, iters, a.steps, version + 1)
            version += a.steps
            rounds.append((base_r, off_r, on_r))
        # paired differences within a round, then the median over rounds: robust to load swings
        base, off, on = (statistics.median(x) for x in zip(*rounds, strict=True))
        d_on = statistics.median(r[2] - r[0] for r in rounds)
        d_off = statistics.median(r[1] - r[0] for r in rounds)
        overlap_ratio = d_on / sync_s
        print(
            f"learner step: compute only {base:.3f} s, overlap off {off:.3f} s, overlap on {on:.3f} s"
            f"\noverlap step ratio (on - base) / sync = {overlap_ratio:.3f}"
            f"  (off: {d_off / sync_s:.3f}; medians over {a.repeat} rounds of paired differences)",
            flush=True,
        )
    finally:
        b.close()
        engine.stop()
        tmp.cleanup()
    print(
        json.dumps(
            {
                "bench": "weights",
                "bandwidth_ratio": round(bw_ratio, 3),
                "overlap_step_ratio": round(overlap_ratio, 3),
                "load_format": default,
                **{f"bandwidth_ratio_{f}": round(ratio[f], 3) for f in formats},
                "params_m": round(params / 1e6, 1),
                "bytes": nbytes,
                "bucket_mb": a.bucket_mb,
                **{f"{k}_s": round(v, 3) for k, v in best.items()},
                **{f"{k}_gbps": round(v, 3) for k, v in gbps.items() if not k.endswith("sync")},
                "verify_s": round(verify_s, 3),
                "step_base_s": round(base, 3),
                "step_overlap_off_s": round(off, 3),
                "step_overlap_on_s": round(on, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
