"""Build the CPU demo's inputs: a random tiny Qwen3 and the synthetic task's jsonl files. No download.

    python tools/make_demo.py [--out build/demo] [--task sort] [--seed 0]

writes ``OUT/model`` (Qwen3ForCausalLM: hidden 128, 2 layers, 4 heads / 4 KV heads, intermediate 512,
tied embeddings, 64 positions: small enough to learn by RL in a minute on 2 cores, with the
char tokenizer of tools/make_tiny_model.py) and ``OUT/data/{train,eval}.jsonl``. With ``--pairs-dir``
(`make demo-rlhf`) also the reward model's preference pairs of the same task,
``PAIRS_DIR/{train,eval}.jsonl`` (:func:`asyncrl.tasks.write_preferences`: the right answer over a
near miss, shuffled or edited (``negatives: mixed``); ``--pairs`` training pairs, 500 held out). Idempotent: existing outputs made with the same
arguments are kept, so `make demo` can be re-run cheaply.

The agent demo (`make demo-agent`) is ``--task lookup --out build/demo_agent``: the same model with
128 positions, room for a tool call, its result and the answer (~90 characters). The
mixture-of-experts demo (`make demo-moe`) is ``--arch qwen3_moe --out build/demo_moe``: a
Qwen3-MoE of the same size (:data:`MOE_MODEL`) and the same data.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl import tasks  # noqa: E402
from tools.make_tiny_model import make_tiny_model  # noqa: E402

MODEL = dict(
    arch="qwen3",
    hidden=128,
    layers=2,
    heads=4,
    kv_heads=4,
    intermediate=512,
    max_positions=64,
    tie_embeddings=True,
)
MOE_MODEL = dict(
    MODEL,
    arch="qwen3_moe",
    experts=8,
    top_k=2,
    moe_intermediate=128,
)
"""`make demo-moe`'s model (``--arch qwen3_moe``): MODEL's attention, and in each layer 8 experts of
width 128, 2 per token (Qwen3-30B-A3B's layout: top-k weights renormalized, no shared expert). The
active MLP width per token, 2 x 128, is half the dense demo's 512, the experts' total twice it."""
MODELS = {"qwen3": MODEL, "qwen3_moe": MOE_MODEL}
MAX_POSITIONS = {"lookup": 128}
"""Tasks whose episodes need more than MODEL's positions (a tool call and its result)."""


def model_config(task: str, arch: str = "qwen3") -> dict:
    """The ``arch`` demo model (MODELS), with the positions ``task`` needs."""
    base = MODELS[arch]
    return {**base, "max_positions": MAX_POSITIONS.get(task, base["max_positions"])}


def make_demo(
    out: str | Path,
    *,
    task: str = "sort",
    seed: int = 0,
    train: int = 20000,
    eval: int = 500,
    arch: str = "qwen3",
) -> Path:
    """Make (or keep) the demo model and data under ``out``; returns ``out``."""
    out = Path(out)
    stamp = out / "made_with.json"
    model = model_config(task, arch)
    args = {"task": task, "seed": seed, "train": train, "eval": eval, "model": model}
    if stamp.is_file() and json.loads(stamp.read_text()) == args:
        return out
    make_tiny_model(out / "model", seed=seed, **model)
    tasks.write_task(task, out / "data", train=train, eval=eval, seed=seed)
    stamp.write_text(json.dumps(args))
    return out


def make_pairs(out: str | Path, *, task: str = "sort", seed: int = 0, train: int = 4000) -> Path:
    """Make (or keep) the reward model's preference pairs under ``out``; returns ``out``."""
    out = Path(out)
    stamp = out / "made_with.json"
    args = {
        "task": task,
        "seed": seed,
        "train": train,
        "eval": PAIRS_EVAL,
        "negatives": "mixed",
        "edits": "1..len",
    }
    if stamp.is_file() and json.loads(stamp.read_text()) == args:
        return out
    tasks.write_preferences(task, out, train=train, eval=PAIRS_EVAL, seed=seed, negatives="mixed")
    stamp.write_text(json.dumps(args))
    return out


PAIRS_EVAL = 500
"""Held-out pairs: the reward model's ``rm/eval_accuracy`` is measured on them."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="build/demo")
    p.add_argument("--task", default="sort", choices=list(tasks.TASKS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train", type=int, default=20000)
    p.add_argument("--eval", type=int, default=500)
    p.add_argument(
        "--arch",
        default="qwen3",
        choices=list(MODELS),
        help="qwen3_moe: the mixture-of-experts demo's model (`make demo-moe`, build/demo_moe)",
    )
    p.add_argument("--pairs-dir", help="also write the reward model's preference pairs here")
    p.add_argument("--pairs", type=int, default=4000, help="training preference pairs")
    a = p.parse_args(argv)
    out = make_demo(a.out, task=a.task, seed=a.seed, train=a.train, eval=a.eval, arch=a.arch)
    print(f"demo model and data in {out}")
    if a.pairs_dir:
        pairs = make_pairs(a.pairs_dir, task=a.task, seed=a.seed, train=a.pairs)
        print(f"preference pairs in {pairs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
