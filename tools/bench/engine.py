"""Benchmark the built-in engine against transformers' `generate`, and the stall a weight update causes.

    python tools/bench/engine.py [--requests 64] [--min-new 8] [--max-new 128] [--updates 8] [--repeats 3]

One run, side by side, on the same tiny Qwen3 (tools/make_tiny_model.py defaults, ~0.5M params):
1. Throughput: 64 requests with max_new_tokens spread evenly from 8 to 128 (sampled, temperature 1,
   ignore_eos). Baseline: transformers `generate` on static left-padded batches (one batch of all
   requests, and batches of 16 sorted by length; the faster one counts). Ours: `asyncrl engine` as a
   child process, the same requests sent concurrently over HTTP. Tokens/s counts requested tokens only.
2. Update stall: while the engine decodes a second wave (64 requests x 480 tokens), this process
   joins its weight group as rank 0 (gloo) and pushes the full weights `--updates` times
   (begin/update/end, no pause). An update's window runs from its begin call to the first decode step
   that ends after the swap. Per update: largest gap between two decode steps in the window divided by
   the median gap of the 50 steps before it (same batch, same load). `update_gap_ratio` is the median
   of that over updates (`_worst`: the max). `control_gap_ratio` does the same for equally many steps
   just before each window, with no update running: what machine noise alone gives.
Last line: JSON {"bench": "engine", "throughput_ratio", "update_gap_ratio", ...}.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from asyncrl.engine import start_engine_process  # noqa: E402
from asyncrl.transport import free_port  # noqa: E402
from asyncrl.weights import buckets, rendezvous  # noqa: E402
from tools.make_tiny_model import make_tiny_model  # noqa: E402


def workload(n: int, lo: int, hi: int, seed: int = 0) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        plen = int(torch.randint(4, 17, (1,), generator=g))
        prompt = torch.randint(3, 90, (plen,), generator=g).tolist()
        new = lo + round(i * (hi - lo) / max(n - 1, 1))
        out.append((prompt, new))
    return out


def hf_static(model, work, batch_size: int, sort: bool) -> float:
    """Seconds for transformers.generate over static left-padded batches."""
    items = sorted(work, key=lambda w: w[1]) if sort else list(work)
    t0 = time.perf_counter()
    for i in range(0, len(items), batch_size):
        chunk = items[i : i + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, (p, _) in enumerate(chunk):
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        new = max(n for _, n in chunk)
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=0,
            )
    return time.perf_counter() - t0


def run_engine(url: str, work) -> tuple[float, list[dict]]:
    """Send every request at once (one thread and connection each); seconds until the last answer.

    A plain ``http.client`` keeps the client's own CPU use small: it shares the 2 cores."""
    host, port = url.removeprefix("http://").split(":")
    results: list[dict | None] = [None] * len(work)

    def one(i, prompt, new):
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": new, "ignore_eos": True}}
        conn = http.client.HTTPConnection(host, int(port), timeout=300)
        conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        results[i] = json.loads(conn.getresponse().read())
        conn.close()

    threads = [threading.Thread(target=one, args=(i, p, n)) for i, (p, n) in enumerate(work)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    for (_, n), r in zip(work, results, strict=True):
        assert r is not None and r["meta_info"]["completion_tokens"] == n, r
    return dt, results  # type: ignore[return-value]


class Post:
    """One HTTP POST in a thread: post, broadcast, then join (how a trainer drives SGLang)."""

    def __init__(self, client: httpx.Client, path: str, body: dict):
        self.resp: httpx.Response | None = None
        self._t = threading.Thread(target=self._run, args=(client, path, body))
        self._t.start()

    def _run(self, client, path, body):
        self.resp = client.post(path, json=body)

    def join(self) -> httpx.Response:
        self._t.join()
        assert self.resp is not None
        return self.resp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--min-new", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--updates", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    tmp = tempfile.TemporaryDirectory(prefix="bench-engine-")
    path = make_tiny_model(Path(tmp.name) / "tiny_qwen3")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    work = workload(a.requests, a.min_new, a.max_new)
    tokens = sum(n for _, n in work)

    ep = start_engine_process(path, port=0, max_batch_size=a.requests)
    try:
        run_engine(ep.url, work[:8])  # warm up both sides
        hf_static(model, work[:4], 4, False)
        hf_one, hf_sorted, ours = [], [], []
        for _ in range(a.repeats):  # interleaved, so machine load hits both alike
            hf_one.append(hf_static(model, work, len(work), sort=False))
            hf_sorted.append(hf_static(model, work, 16, sort=True))
            ours.append(run_engine(ep.url, work)[0])
        t_hf = min(min(hf_one), min(hf_sorted))
        t_ours = min(ours)
        print(f"model: {n_params} params; {len(work)} requests, {tokens} tokens requested")
        print(f"transformers generate, one static batch: {tokens / min(hf_one):8.0f} tok/s")
        print(f"transformers generate, sorted batches of 16: {tokens / min(hf_sorted):8.0f} tok/s")
        print(f"asyncrl engine (HTTP, continuous batching): {tokens / t_ours:8.0f} tok/s")

        # ---- weight updates during decoding ----
        client = httpx.Client(base_url=ep.url, timeout=300)
        port = free_port()
        init = {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "bench",
            "backend": "gloo",
        }
        init_call = Post(client, "/init_weights_update_group", init)
        pg = rendezvous.init_custom_process_group(
            master_address="127.0.0.1", master_port=port, rank=0, world_size=2, group_name="bench"
        )
        assert init_call.join().json()["success"]
        named = [(n, p.detach().clone()) for n, p in model.named_parameters()]
        bucket = buckets.Bucket(names=[n for n, _ in named], tensors=[t for _, t in named])
        long_work = [(p, 480) for p, _ in work]  # long enough to span all updates
        wave_start = time.time()
        waver = threading.Thread(target=run_engine, args=(ep.url, long_work))
        waver.start()
        steps0 = client.get("/engine_stats").json()["decode_steps"]
        while (
            client.get("/engine_stats").json()["decode_steps"] < steps0 + 60
        ):  # decoding under way
            time.sleep(0.02)
        windows, pauses = [], []
        for k in range(a.updates):
            w0 = time.time()
            assert client.post("/begin_weight_update", json={}).json()["success"]
            body = {**bucket.meta(), "group_name": "bench", "flush_cache": False}
            body.update(weight_version=f"v{k + 1}", load_format="flattened_bucket")
            call = Post(client, "/update_weights_from_distributed", body)
            dist.broadcast(buckets.flatten(bucket.tensors), src=0, group=pg)
            assert call.join().json()["success"]
            end = client.post("/end_weight_update", json={}).json()
            pauses.append(end["pause_s"])
            windows.append((w0, end["swap_ts"]))
            time.sleep(0.2)
        waver.join()
        stats = client.get("/engine_stats", params={"since": wave_start}).json()
        gaps = stats["gaps"]
        all_gaps = [g[1] for g in gaps]
        # an update's window runs from begin to the first step that ends after the swap; its
        # largest gap is compared with the median of the 50 steps before it (same batch size)
        ratios, controls, per_update, inside, cpu_of_worst = [], [], [], set(), []
        for w0, swap in windows:
            idx = [i for i, g in enumerate(gaps) if w0 <= g[0]]
            last = next((i for i in idx if gaps[i][0] >= swap), None)
            idx = [i for i in idx if last is None or i <= last]
            inside.update(idx)
            before = [g[1] for g in gaps[max(0, idx[0] - 50) : idx[0]]] if idx else []
            worst_i = max(idx, key=lambda i: gaps[i][1]) if idx else None
            worst_here = gaps[worst_i][1] if idx else float("nan")
            if idx:
                cpu_of_worst.append(gaps[worst_i][2] / gaps[worst_i][1])
            per_update.append(worst_here)
            base = statistics.median(before) if before else float("nan")
            ratios.append(worst_here / base)
            # control: the same number of steps just before the window, with no update running
            ctrl = before[-len(idx) :] if idx else []
            controls.append(max(ctrl) / base if ctrl else float("nan"))
        in_update = [gaps[i][1] for i in sorted(inside)]
        median = statistics.median(all_gaps)
        worst = max(per_update)
        typical = statistics.median(per_update)
        outside = sorted(g[1] for i, g in enumerate(gaps) if i not in inside)
        p99 = outside[int(0.99 * (len(outside) - 1))] if outside else float("nan")
        print(
            f"decode steps in the update wave: {len(all_gaps)}; median gap {median * 1e3:.2f} ms; "
            f"p99 gap outside updates {p99 * 1e3:.2f} ms"
        )
        print(
            f"{a.updates} full-weight updates ({bucket.nbytes / 1e6:.1f} MB each): {len(in_update)} steps "
            f"inside update windows; largest gap per update: median {typical * 1e3:.2f} ms, "
            f"max {worst * 1e3:.2f} ms; swap pauses "
            f"{', '.join(f'{p * 1e6:.0f}us' for p in pauses)}; largest gap / median of the 50 "
            f"steps before, per update: {', '.join(f'{r:.2f}' for r in ratios)}"
        )
        typical_share = statistics.median(g[2] / g[1] for g in gaps if g[1] > 0)
        print(
            "decode-thread CPU share of each update's largest gap (low = waiting for a core or the "
            f"GIL, not working): {', '.join(f'{c:.2f}' for c in cpu_of_worst)}; "
            f"median over all steps {typical_share:.2f}"
        )
        print(
            "control (equally many steps just before each update, no update running): "
            f"{', '.join(f'{r:.2f}' for r in controls)}"
        )
        client.post("/destroy_weights_update_group", json={"group_name": "bench"})
        rendezvous.destroy_process_group(pg)
        client.close()
    finally:
        ep.stop()
    result = {
        "bench": "engine",
        "throughput_ratio": round(t_hf / t_ours, 3),
        "update_gap_ratio": round(statistics.median(ratios), 3),
        "update_gap_ratio_worst": round(max(ratios), 3),
        "control_gap_ratio": round(statistics.median(controls), 3),
        "cpu_share_worst_update_gap": round(statistics.median(cpu_of_worst), 3),
        "cpu_share_typical_step": round(typical_share, 3),
        "engine_tok_s": round(tokens / t_ours, 1),
        "hf_generate_tok_s": round(tokens / t_hf, 1),
        "median_step_gap_ms": round(median * 1e3, 3),
        "max_step_gap_in_update_ms": round(worst * 1e3, 3),
        "p99_step_gap_outside_updates_ms": round(p99 * 1e3, 3),
        "max_swap_pause_us": round(max(pauses) * 1e6, 1),
        "requests": len(work),
        "params": n_params,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
