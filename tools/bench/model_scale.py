"""How a learner step, a weight sync and memory grow with model size, 0.5M → 600M parameters: a few
asynchronous RL steps through `asyncrl run` (built-in engine, gloo) per size, on this machine.

Sizes: the demo's tiny Qwen3 (hidden 128, 2 layers, 100-token vocabulary), then models with Qwen3's
real 151,936-token vocabulary up to the real Qwen3-0.6B configuration (random weights, built
locally: tools/make_tiny_model.py). Every run uses the recipe's default ``learner.micro_batch_tokens``
and ``learner.logits_chunk_mb``. Per size it reads the run's metrics: mean learner step seconds and
weight-sync seconds over the steps after the first, the learner's peak resident memory, and the
run's wall time. The last line is JSON:

    {"bench": "model_scale", "rows": [{"flavour", "params", "step_s", "sync_s", "learner_rss_gib", ...}]}

    python tools/bench/model_scale.py [--flavours tiny small medium qwen3-0.6b] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.make_tiny_model import FLAVOURS  # noqa: E402

VOCAB = FLAVOURS["qwen3-0.6b"]["vocab_size"]
SIZES = {
    "tiny": dict(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=512),
    "small": dict(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=768, vocab_size=VOCAB),
    "medium": dict(hidden=512, layers=12, heads=8, kv_heads=4, intermediate=1536, vocab_size=VOCAB),
    "qwen3-0.6b": FLAVOURS["qwen3-0.6b"],
}


def model_dir(flavour: str, cache: Path) -> Path:
    from tools.make_tiny_model import make_tiny_model

    d = cache / flavour
    if not (d / "config.json").is_file():
        make_tiny_model(d, **{"max_positions": 512, **SIZES[flavour]})
    return d


def params(d: Path) -> int:
    """Parameters stored in the folder's safetensors (tied embeddings once)."""
    import math

    from safetensors import safe_open

    n = 0
    for f in d.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            n += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return n


def one_run(flavour: str, model: Path, steps: int, out: Path) -> dict:
    from asyncrl import tasks
    from asyncrl.metrics import read_metrics

    train, evals = tasks.write_task("sort", out / "data", train=2000, eval=8)
    recipe = {
        "run": {
            "name": flavour,
            "output_dir": str(out / "runs"),
            "steps": steps,
            "eval_prompts": 0,
            "timeout_s": 7200,
        },
        "model": {"path": str(model), "max_seq_len": 64},
        "data": {"path": str(train), "eval_path": str(evals)},
        "rollout": {"workers": 1, "group_size": 4, "max_new_tokens": 8, "max_concurrent_groups": 4},
        "generator": {"kind": "builtin", "engines_per_worker": 1, "startup_timeout_s": 1800},
        "buffer": {"groups_per_batch": 4, "max_staleness": 1, "batch_timeout_s": 3600},
        "algorithm": {"loss": "decoupled_ppo"},
        # a synchronous checkpoint: an async one stages a second copy of model and optimizer
        "learner": {"lr": 1e-5, "checkpoint_every": 0, "checkpoint_async": False},
        "weights": {"backend": "gloo", "timeout_s": 600, "dtype": "bfloat16"},
        "logging": {"wandb_mode": "disabled", "progress": False},
    }
    path = out / f"{flavour}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "run", str(path), "--overwrite"],
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(
            f"model_scale: {flavour} failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    recs = [r for r in read_metrics(out / "runs" / flavour) if r.get("process") == "learner"]

    def mean_after_first(key: str) -> float | None:
        ys = [r[key] for r in recs if isinstance(r.get(key), int | float)]
        ys = ys[1:] if len(ys) > 1 else ys
        return sum(ys) / len(ys) if ys else None

    return {
        "flavour": flavour,
        "step_s": mean_after_first("learner/step_s"),
        "sync_s": mean_after_first("weights/sync_s"),
        "learner_rss_gib": max((r.get("learner/max_rss_gib", 0.0) for r in recs), default=None),
        "steps": len(recs),
        "wall_s": wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavours", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--cache", default=str(Path.home() / ".cache/asyncrl/models"))
    p.add_argument("--out", default=str(ROOT / "runs/bench_model_scale"))
    a = p.parse_args()
    rows = []
    for flavour in a.flavours:
        model = model_dir(flavour, Path(a.cache))
        row = {"params": params(model), **one_run(flavour, model, a.steps, Path(a.out))}
        rows.append(row)
        print(
            f"{flavour:>11}: {row['params'] / 1e6:7.1f}M params  step {row['step_s']:7.2f} s  "
            f"sync {row['sync_s'] or 0:6.2f} s  learner peak RSS {row['learner_rss_gib']:5.2f} GiB  "
            f"({row['steps']} steps, {row['wall_s']:.0f} s wall)",
            flush=True,
        )
    print(json.dumps({"bench": "model_scale", "rows": rows}))


if __name__ == "__main__":
    main()
