"""Benchmark the rollout worker's overhead: generated tokens/s through the worker against the same
requests sent straight to the engine.

    python tools/bench/rollout.py [--groups 32] [--group-size 8] [--concurrent-groups 4]
                                  [--max-new-tokens 64] [--rounds 3]

One run, side by side, on the same tiny Qwen3 (tools/make_tiny_model.py defaults) served by one
`asyncrl engine` child process:
- direct: ``groups x group_size`` ``/generate`` requests (the worker's exact JSON: sampled,
  temperature 1, return_logprob) in the worker's shape (``concurrent_groups`` slots; a slot sends one
  prompt's ``group_size`` requests at once and waits for all of them) from a plain httpx client on
  trio: the same requests arriving the same way, nothing else;
- worker: the real RolloutWorker delivering the same number of groups of the same prompts, with the
  same concurrency, into the real BufferService on loopback nng: admission, tokenizing, rewards,
  version bookkeeping and Put/Ack included.
Rounds alternate direct and worker (the machine is shared), and the ratio is the median of the
per-round ratios. The buffer service runs in a child process, as it runs in the learner in a real
run. On a loaded machine wall-clock rates swing with other processes, so the bench also counts CPU
seconds per generated token (engine from /proc; client/worker from process_time while requests run,
set-up excluded):
``cpu_efficiency_ratio`` = direct
(client + engine) CPU per token / worker (worker + engine) CPU per token, which does not depend on
what else runs. Last line: JSON {"bench": "rollout", "overhead_ratio": worker/direct tokens/s, ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx  # noqa: E402
import trio  # noqa: E402

from asyncrl.buffer.client import BufferClient  # noqa: E402
from asyncrl.buffer.service import BufferService  # noqa: E402
from asyncrl.engine import start_engine_process  # noqa: E402
from asyncrl.recipe import BufferConfig  # noqa: E402
from asyncrl.rewards import RewardRunner, exact_match  # noqa: E402
from asyncrl.rollout.generator_pool import GeneratorPool  # noqa: E402
from asyncrl.rollout.prompts import PromptSource  # noqa: E402
from asyncrl.rollout.sglang_protocol import SamplingParams  # noqa: E402
from asyncrl.rollout.worker import RolloutWorker  # noqa: E402
from asyncrl.rollout.worker_config import WorkerConfig  # noqa: E402
from asyncrl.rollout.workflows import SingleTurn  # noqa: E402
from tools.make_tiny_model import make_tiny_model  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (and its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prompts(n: int) -> list[dict]:
    return [{"prompt": f"{10 + i % 90}+{10 + (7 * i) % 90}=", "answer": "0"} for i in range(n)]


async def direct(url: str, tok, rows: list[dict], n: int, groups_at_once: int, params):
    """The same requests in the same shape as the worker sends them (``groups_at_once`` slots,
    each sends one prompt's ``n`` requests together and waits for all), with nothing else: no
    buffer, no rewards, no bookkeeping. Returns (tokens, seconds, CPU seconds)."""
    queue = [tok.encode(r["prompt"]) for r in rows]
    tokens = 0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)  # as the pool
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:

        async def one(ids: list[int]) -> None:
            nonlocal tokens
            body = {
                "input_ids": ids,
                "sampling_params": params.to_json(),
                "return_logprob": True,
                "stream": False,
            }
            r = await http.post(url + "/generate", json=body)
            r.raise_for_status()
            tokens += len(r.json()["meta_info"]["output_token_logprobs"])

        async def slot() -> None:
            while queue:
                ids = queue.pop(0)
                async with trio.open_nursery() as group:
                    for _ in range(n):
                        group.start_soon(one, ids)

        t0, c0 = trio.current_time(), time.process_time()
        async with trio.open_nursery() as nursery:
            for _ in range(groups_at_once):
                nursery.start_soon(slot)
        return tokens, trio.current_time() - t0, time.process_time() - c0


def serve_buffer(address: str, pub_address: str, groups_per_batch: int) -> int:
    """Child-process mode: the real buffer service, as the learner's rank 0 would host it."""
    import signal
    import threading

    cfg = BufferConfig(
        address=address,
        pub_address=pub_address,
        groups_per_batch=groups_per_batch,
        max_staleness=0,
        lease_seconds=600,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with BufferService(cfg):
        stop.wait()
    return 0


async def through_worker(
    url: str, tok, rows: list[dict], n: int, groups_at_once: int, params: SamplingParams
):
    """The worker delivering len(rows) groups into a real buffer service in its own process (as
    in a real run, where it lives in the learner); returns (tokens, seconds, CPU seconds)."""
    with tempfile.TemporaryDirectory(prefix="bench-buffer-") as d:
        address, pub = f"ipc://{d}/buffer.ipc", f"ipc://{d}/pub.ipc"
        argv = [sys.executable, __file__, "--serve-buffer", address, pub, str(len(rows))]
        async with trio.open_nursery() as nursery:
            proc = await nursery.start(trio.run_process, argv)
            try:
                async with (
                    BufferClient(address, worker_id="bench", timeout_s=30) as buffer,
                    GeneratorPool([url]) as pool,
                ):
                    await buffer.status()  # the service is up
                    worker = RolloutWorker(
                        WorkerConfig(
                            worker_id="bench",
                            group_size=n,
                            max_concurrent_groups=groups_at_once,
                            max_staleness=0,
                            max_groups=len(rows),
                            metrics_every_s=3600,
                        ),
                        buffer=buffer,
                        pool=pool,
                        source=PromptSource(rows, name="bench", shuffle=False),
                        tokenizer=tok,
                        workflow=SingleTurn(),
                        reward=RewardRunner(exact_match, timeout_s=10),
                        params=params,
                    )
                    t0, c0 = trio.current_time(), time.process_time()
                    stats = await worker.run()
                    dt, cpu = trio.current_time() - t0, time.process_time() - c0
                    stored = (await buffer.status()).stats["stored_total"]
            finally:
                proc.terminate()
        assert stats.counters["groups_delivered"] == len(rows) == stored, (stats.counters, stored)
        return stats.counters["tokens_generated"], dt, cpu


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--concurrent-groups", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--serve-buffer", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve_buffer:
        return serve_buffer(a.serve_buffer[0], a.serve_buffer[1], int(a.serve_buffer[2]))

    from transformers import AutoTokenizer

    tmp = tempfile.TemporaryDirectory(prefix="bench-rollout-")
    model = make_tiny_model(Path(tmp.name) / "tiny_qwen3")
    tok = AutoTokenizer.from_pretrained(model)
    conc = a.concurrent_groups * a.group_size
    params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=1.0)
    rows = prompts(a.groups)
    engine = start_engine_process(model, max_batch_size=conc)
    results = []
    try:
        trio.run(direct, engine.url, tok, rows[:4], a.group_size, a.concurrent_groups, params)
        for rnd in range(a.rounds):

            def timed(fn):
                e = cpu_seconds(engine.pid)
                tokens, secs, cpu = trio.run(
                    fn, engine.url, tok, rows, a.group_size, a.concurrent_groups, params
                )
                return tokens, secs, cpu, cpu_seconds(engine.pid) - e

            if rnd % 2 == 0:  # alternate which goes first: no order bias
                d_tok, d_s, d_c, d_e = timed(direct)
                w_tok, w_s, w_c, w_e = timed(through_worker)
            else:
                w_tok, w_s, w_c, w_e = timed(through_worker)
                d_tok, d_s, d_c, d_e = timed(direct)
            d_tps, w_tps = d_tok / d_s, w_tok / w_s
            d_cpu, w_cpu = d_c / d_tok * 1e6, w_c / w_tok * 1e6
            d_eng, w_eng = d_e / d_tok * 1e6, w_e / w_tok * 1e6
            results.append(
                {
                    "direct_tps": d_tps,
                    "worker_tps": w_tps,
                    "ratio": w_tps / d_tps,
                    "direct_cpu_us_per_token": d_cpu,
                    "worker_cpu_us_per_token": w_cpu,
                    "engine_cpu_us_per_token_direct": d_eng,
                    "engine_cpu_us_per_token_worker": w_eng,
                    "cpu_ratio": (d_cpu + d_eng) / (w_cpu + w_eng),
                }
            )
            print(
                f"round {rnd}: direct {d_tok} tokens in {d_s:.2f}s = {d_tps:.0f} tok/s "
                f"(CPU/token: client {d_cpu:.0f} us, engine {d_eng:.0f} us); "
                f"worker {w_tok} tokens in {w_s:.2f}s = {w_tps:.0f} tok/s "
                f"(CPU/token: worker {w_cpu:.0f} us, engine {w_eng:.0f} us); "
                f"ratio {w_tps / d_tps:.3f}",
                flush=True,
            )
    finally:
        engine.stop()
        tmp.cleanup()
    summary = {
        "bench": "rollout",
        "overhead_ratio": round(statistics.median(r["ratio"] for r in results), 4),
        "direct_tokens_per_s": round(statistics.median(r["direct_tps"] for r in results), 1),
        "worker_tokens_per_s": round(statistics.median(r["worker_tps"] for r in results), 1),
        "ratios": [round(r["ratio"], 4) for r in results],
        "direct_client_cpu_us_per_token": round(
            statistics.median(r["direct_cpu_us_per_token"] for r in results), 1
        ),
        "worker_cpu_us_per_token": round(
            statistics.median(r["worker_cpu_us_per_token"] for r in results), 1
        ),
        "engine_cpu_us_per_token_direct": round(
            statistics.median(r["engine_cpu_us_per_token_direct"] for r in results), 1
        ),
        "engine_cpu_us_per_token_worker": round(
            statistics.median(r["engine_cpu_us_per_token_worker"] for r in results), 1
        ),
        "cpu_efficiency_ratio": round(statistics.median(r["cpu_ratio"] for r in results), 4),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "groups": a.groups,
        "group_size": a.group_size,
        "in_flight": conc,
        "max_new_tokens": a.max_new_tokens,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
