"""Peak memory of one learner step against vocabulary size × trained tokens: chunked log-probabilities
(``learner.logits_chunk_mb``) against the full logits (a budget no batch reaches), side by side;
and, with ``--sweep``, the output projection alone at a real width: time per token and peak memory
of ``chunked_logprobs`` + ``chunked_backward`` for several chunk budgets, to choose the default.

Each configuration runs in its own process (a small model: hidden 64, 2 layers, the given
vocabulary), with glibc returning large frees to the system (``MALLOC_MMAP_THRESHOLD_``), so resident
memory follows live tensors. A warm-up step allocates the optimizer state; the peak of the second
step over the resident memory before it is the step's transient memory: logits, softmax, gradients.
The last line is JSON:

    {"bench": "logprob_memory", "rows": [...], "chunked_growth": ..., "full_growth": ...}

    python tools/bench/logprob_memory.py [--vocab 8192 151936] [--tokens 512 2048] [--chunk-mb 32]

The sweep (vocabulary 151,936, hidden 1024: Qwen3-0.6B's projection; one process per budget):

    {"bench": "logprob_chunk_sweep", "rows": [{"chunk_mb", "chunk_tokens", "chunks", "s_per_token",
     "peak_mib", "grad_head_add_mib"}, ...]}

    python tools/bench/logprob_memory.py --sweep [--tokens 2048] [--dtype float32 bfloat16]
        [--sweep-mb 64 256 1024 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

FULL_MB = 1e9  # a chunk budget no batch reaches: the whole micro-batch's logits at once


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rl_batch(vocab: int, n: int, per: int, *, prompt_len: int, rng: Any, tag: str = "") -> Any:
    """One group of ``n`` random samples (``prompt_len`` prompt and ``per`` completion tokens,
    uniform behaviour logprobs, rewards 0 and 1 in turn): a learner step of a known size."""
    import numpy as np

    from asyncrl import wire
    from asyncrl.learner.source import Batch

    samples = [
        wire.Sample(
            id=f"{tag}{i}",
            group_id="g",
            prompt_ids=rng.integers(3, vocab, prompt_len).astype(np.int32),
            completion_ids=rng.integers(3, vocab, per).astype(np.int32),
            behavior_logprobs=np.full(per, -np.log(vocab), np.float32),
            versions=np.zeros(per, np.int32),
            loss_mask=np.ones(per, np.float32),
            reward=float(i % 2),
        )
        for i in range(n)
    ]
    return Batch(groups=[wire.Group(id="g", samples=samples)], version=0, stats={})


def one(model_dir: str, tokens: int, chunk_mb: float) -> dict:
    """Run in the child: two steps on ``tokens`` trained tokens; the second step's transient peak."""
    import numpy as np
    import torch

    from asyncrl import recipe as recipe_mod
    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.trainer import Trainer

    torch.set_num_threads(1)
    per, n = 128, tokens // 128
    recipe = recipe_mod.from_dict(
        {
            "model": {"path": model_dir, "max_seq_len": 256},
            "algorithm": {"loss": "tis"},
            "learner": {
                "lr": 1e-4,
                "micro_batch_tokens": tokens + 8 * n,
                "logits_chunk_mb": chunk_mb,
            },
            "buffer": {"max_staleness": 4},
            "run": {"output_dir": tempfile.mkdtemp()},
        }
    )
    trainer = Trainer(TrainerConfig.from_recipe(recipe), checkpointing=False)
    vocab = trainer.models.spec.model.vocab_size
    rng = np.random.default_rng(0)

    trainer.step(rl_batch(vocab, n, per, prompt_len=4, rng=rng))  # optimizer state, first touch
    trainer.version = 0
    b = rl_batch(vocab, n, per, prompt_len=4, rng=rng)
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to now
    before = _status_kib("VmRSS")
    trainer.step(b)
    peak = _status_kib("VmHWM")
    return {
        "vocab": vocab,
        "tokens": n * per,
        "chunk_mb": chunk_mb,
        "peak_mib": (peak - before) / 1024,
    }


def sweep_one(vocab: int, hidden: int, tokens: int, dtype: str, chunk_mb: float) -> dict:
    """Run in the child: the learner's two passes through a ``vocab`` × ``hidden`` projection on
    ``tokens`` rows at one chunk budget (a warm-up on one chunk first: kernels, thread pools);
    the timed run's wall and its peak resident memory over the inputs'."""
    import time

    import torch

    from asyncrl.learner.logprobs import chunk_tokens, chunked_backward, chunked_logprobs

    torch.set_num_threads(1)
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False, dtype=dt)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g) * hidden**-0.5)
    h = torch.randn(tokens, hidden, generator=g).to(dt)
    y = torch.randint(0, vocab, (tokens,), generator=g)
    g_lp, g_ent = torch.randn(tokens, generator=g), torch.randn(tokens, generator=g) * 0.1
    chunk = min(chunk_tokens(vocab, chunk_mb), tokens)

    def run(n: int) -> None:
        kw = {"temperature": 0.7, "chunk": chunk}
        chunked_logprobs(h[:n], y[:n], head, **kw)
        chunked_backward(h[:n], y[:n], head, g_lp[:n], g_ent[:n], sync_gradients=True, **kw)
        head.weight.grad = None

    run(chunk)
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    t0, c0 = time.perf_counter(), time.process_time()
    run(tokens)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    chunks = -(-tokens // chunk)
    return {
        "vocab": vocab,
        "hidden": hidden,
        "tokens": tokens,
        "dtype": dtype,
        "chunk_mb": chunk_mb,
        "chunk_tokens": chunk,
        "chunks": chunks,
        "s_per_token": wall / tokens,
        # this process's CPU time (user + system: page faults included), less moved by other
        # jobs on the machine than the wall
        "cpu_s_per_token": cpu / tokens,
        "peak_mib": (_status_kib("VmHWM") - before) / 1024,
        # the projection's gradient is added into once per chunk after the first: hidden × vocab
        # elements of the parameter's dtype read twice and written once each time
        "grad_head_add_mib": (chunks - 1) * 3 * hidden * vocab * dt.itemsize / 2**20,
    }


def sweep(a: argparse.Namespace) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    rows = []
    for dtype in a.dtype:
        for mb in [*a.sweep_mb, FULL_MB]:
            cmd = [sys.executable, __file__, "--sweep-one", str(a.vocab[-1]), str(a.hidden)]
            cmd += [str(a.tokens[-1]), dtype, str(mb)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            name = "whole" if mb == FULL_MB else f"{mb:g} MiB"
            print(
                f"{dtype:>8}  {name:>9}: {row['chunk_tokens']:>5} tokens x {row['chunks']:>3} "
                f"chunks  {row['s_per_token'] * 1e3:7.2f} ms/token (CPU time "
                f"{row['cpu_s_per_token'] * 1e3:6.2f})  peak {row['peak_mib']:8.1f} MiB"
                f"  grad adds {row['grad_head_add_mib']:8.0f} MiB",
                flush=True,
            )
    print(json.dumps({"bench": "logprob_chunk_sweep", "rows": rows}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[8192, 151_936])
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--chunk-mb", type=float, default=32.0)
    p.add_argument("--sweep", action="store_true", help="time and peak per chunk budget")
    p.add_argument("--sweep-mb", type=float, nargs="+", default=[64.0, 256.0, 1024.0, 4096.0])
    p.add_argument("--hidden", type=int, default=1024, help="--sweep: the projection's input")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], help="--sweep")
    p.add_argument("--sweep-one", nargs=5, help=argparse.SUPPRESS)
    p.add_argument(
        "--one", nargs=3, metavar=("MODEL", "TOKENS", "CHUNK_MB"), help=argparse.SUPPRESS
    )
    a = p.parse_args()
    if a.sweep_one:
        v, d, t, dtype, mb = a.sweep_one
        print(json.dumps(sweep_one(int(v), int(d), int(t), dtype, float(mb))))
        return
    if a.sweep:
        if a.vocab == p.get_default("vocab"):
            a.vocab = [151_936]
        sweep(a)
        return
    if a.one:
        print(json.dumps(one(a.one[0], int(a.one[1]), float(a.one[2]))))
        return

    from tools.make_tiny_model import make_tiny_model

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for vocab in a.vocab:
            model = make_tiny_model(
                Path(tmp) / f"v{vocab}",
                hidden=64,
                layers=2,
                heads=4,
                kv_heads=2,
                intermediate=256,
                vocab_size=vocab,
            )
            for tokens in a.tokens:
                for chunk in (a.chunk_mb, FULL_MB):
                    out = subprocess.run(
                        [sys.executable, __file__, "--one", str(model), str(tokens), str(chunk)],
                        env=env,
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                    row = json.loads(out.stdout.strip().splitlines()[-1])
                    row["mode"] = "chunked" if chunk == a.chunk_mb else "full"
                    rows.append(row)
                    print(
                        f"vocab {row['vocab']:>7}  tokens {row['tokens']:>5}  {row['mode']:>7}: "
                        f"step peak {row['peak_mib']:8.1f} MiB",
                        flush=True,
                    )

    def growth(mode: str) -> float:
        """peak at the largest vocab × tokens over peak at the smallest (same mode)."""
        sel = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["vocab"] * r["tokens"])
        return sel[-1]["peak_mib"] / max(sel[0]["peak_mib"], 1e-9)

    product = (max(a.vocab) * max(a.tokens)) / (min(a.vocab) * min(a.tokens))
    print(
        f"vocab x tokens grows {product:.0f}x: chunked peak {growth('chunked'):.2f}x, "
        f"full logits peak {growth('full'):.2f}x"
    )
    print(
        json.dumps(
            {
                "bench": "logprob_memory",
                "rows": rows,
                "product_growth": product,
                "chunked_growth": growth("chunked"),
                "full_growth": growth("full"),
            }
        )
    )


if __name__ == "__main__":
    main()
