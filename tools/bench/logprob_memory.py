"""Peak memory of one learner step against vocabulary size × trained tokens: chunked log-probabilities
(``learner.logits_chunk_mb``) against the full logits (a budget no batch reaches), side by side.

Each configuration runs in its own process (a small model: hidden 64, 2 layers, the given
vocabulary), with glibc returning large frees to the system (``MALLOC_MMAP_THRESHOLD_``), so resident
memory follows live tensors. A warm-up step allocates the optimizer state; the peak of the second
step over the resident memory before it is the step's transient memory: logits, softmax, gradients.
The last line is JSON:

    {"bench": "logprob_memory", "rows": [...], "chunked_growth": ..., "full_growth": ...}

    python tools/bench/logprob_memory.py [--vocab 8192 151936] [--tokens 512 2048] [--chunk-mb 32]
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
    trainer = Trainer(recipe, checkpointing=False)
    vocab = trainer.spec.model.vocab_size
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[8192, 151_936])
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--chunk-mb", type=float, default=32.0)
    p.add_argument(
        "--one", nargs=3, metavar=("MODEL", "TOKENS", "CHUNK_MB"), help=argparse.SUPPRESS
    )
    a = p.parse_args()
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
