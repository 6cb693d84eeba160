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
per-round ratios. Last line: JSON {"bench": "rollout", "overhead_ratio": worker/direct tokens/s, ...}.
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
from asyncrl.recipe import BufferConfig  # noqa: E402
from asyncrl.rollout.client import GeneratorPool, SamplingParams  # noqa: E402
from asyncrl.rollout.data import PromptSource  # noqa: E402
from asyncrl.rollout.engine import start_engine_process  # noqa: E402
from asyncrl.rollout.rewards import RewardRunner, exact_match  # noqa: E402
from asyncrl.rollout.worker import RolloutWorker, WorkerConfig  # noqa: E402
from asyncrl.rollout.workflows import SingleTurn  # noqa: E402
from tools.make_tiny_model import make_tiny_model  # noqa: E402


def prompts(n: int) -> list[dict]:
    return [{"prompt": f"{10 + i % 90}+{10 + (7 * i) % 90}=", "answer": "0"} for i in range(n)]


async def direct(url: str, tok, rows: list[dict], n: int, groups_at_once: int, params):
    """The same requests in the same shape as the worker sends them (``groups_at_once`` slots,
    each sends one prompt's ``n`` requests together and waits for all), with nothing else: no
    buffer, no rewards, no bookkeeping. Returns (tokens, seconds)."""
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

        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            for _ in range(groups_at_once):
                nursery.start_soon(slot)
        return tokens, trio.current_time() - t0


async def through_worker(
    url: str, tok, rows: list[dict], n: int, groups_at_once: int, params: SamplingParams
):
    """The worker delivering len(rows) groups into a real buffer; returns (tokens, seconds)."""
    cfg = BufferConfig(
        address="tcp://127.0.0.1:0",
        pub_address="tcp://127.0.0.1:0",
        groups_per_batch=len(rows),
        max_staleness=0,
        lease_seconds=600,
    )
    svc = await trio.to_thread.run_sync(lambda: BufferService(cfg).start())
    try:
        wcfg = WorkerConfig(
            worker_id="bench",
            group_size=n,
            max_concurrent_groups=groups_at_once,
            max_staleness=0,
            max_groups=len(rows),
            metrics_every_s=3600,
        )
        async with (
            BufferClient(svc.address, worker_id="bench") as buffer,
            GeneratorPool([url]) as pool,
        ):
            worker = RolloutWorker(
                wcfg,
                buffer=buffer,
                pool=pool,
                source=PromptSource(rows, name="bench", shuffle=False),
                tokenizer=tok,
                workflow=SingleTurn(),
                reward=RewardRunner(exact_match, timeout_s=10),
                params=params,
            )
            t0 = trio.current_time()
            stats = await worker.run()
            dt = trio.current_time() - t0
        assert stats.counters["groups_delivered"] == len(rows), stats.counters
        assert svc.stats()["stored_total"] == len(rows)
        return stats.counters["tokens_generated"], dt
    finally:
        await trio.to_thread.run_sync(svc.stop)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--concurrent-groups", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)

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
            c0 = time.process_time()
            d_tok, d_s = trio.run(
                direct, engine.url, tok, rows, a.group_size, a.concurrent_groups, params
            )
            c1 = time.process_time()
            w_tok, w_s = trio.run(
                through_worker, engine.url, tok, rows, a.group_size, a.concurrent_groups, params
            )
            c2 = time.process_time()
            d_tps, w_tps = d_tok / d_s, w_tok / w_s
            d_cpu, w_cpu = (c1 - c0) / d_tok * 1e6, (c2 - c1) / w_tok * 1e6
            results.append(
                {
                    "direct_tps": d_tps,
                    "worker_tps": w_tps,
                    "ratio": w_tps / d_tps,
                    "direct_cpu_us_per_token": d_cpu,
                    "worker_cpu_us_per_token": w_cpu,
                }
            )
            print(
                f"round {rnd}: direct {d_tok} tokens in {d_s:.2f}s = {d_tps:.0f} tok/s "
                f"({d_cpu:.0f} us client CPU/token); worker {w_tok} tokens in {w_s:.2f}s = "
                f"{w_tps:.0f} tok/s ({w_cpu:.0f} us CPU/token); ratio {w_tps / d_tps:.3f}",
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
