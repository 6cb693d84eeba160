"""LoRA weight sync against full weights: bytes and seconds per version, and what serving the
adapter costs the built-in engine (merged into the weights at the swap, or a low-rank product at
every decode step).

Per model size (``tiny``: the demo's hidden 128, 2 layers; ``qwen3-0.6b``: Qwen3-0.6B's
configuration, random weights, tools/make_tiny_model.py), on loopback gloo, CPU, float32 on the
wire (the recipe's ``weights.dtype`` default), ``weights.load_format`` list, 512 MiB buckets:

- ``full``: :class:`asyncrl.weights.broadcaster.WeightBroadcaster` (``overlap: false``, verify
  off) sends every weight to a built-in engine, as without LoRA;
- ``lora``: the same broadcaster sends a rank-``--rank`` adapter on all 7 targets (q k v o gate up
  down) to an engine started with ``--lora-rank``; its ``sync_s`` includes the engine's merge
  (base + alpha/r · B A for every target, at the end of the session).
Rows: ``nbytes`` (SyncReport.nbytes), ``sync_s`` (the generators' side) and ``publish_s`` (the
learner's wall time, snapshot included), best of ``--repeat``.

Decode: one decode step of the engine's model (batch ``--batch``, 64 cached positions) with the
merged weights (what the engine serves: the same cost as without LoRA), and the extra time of the
low-rank path (x A^T B^T · scaling added to each of the 7 projections' outputs), and the merge's
time per version (``Adapters.merged`` over every target, into the memory the swap before last
freed, as in the engine), medians.

    .venv/bin/python tools/bench/lora_sync.py [--sizes tiny qwen3-0.6b] [--rank 8] [--repeat 3]

The last line is JSON: {"bench": "lora_sync", "rows": [...]}.
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from asyncrl import wire  # noqa: E402
from asyncrl.engine import start_engine_process  # noqa: E402
from asyncrl.recipe import WeightsConfig  # noqa: E402
from asyncrl.weights.broadcaster import WeightBroadcaster  # noqa: E402
from tools.make_tiny_model import FLAVOURS  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SIZES = {
    "tiny": dict(arch="qwen3", hidden=128, layers=2, heads=4, kv_heads=2, intermediate=512),
    "qwen3-0.6b": {**FLAVOURS["qwen3-0.6b"], "max_positions": 512},
}


def model_dir(size: str, cache: Path) -> Path:
    from tools.make_tiny_model import make_tiny_model

    d = cache / size
    if not (d / "config.json").is_file():
        make_tiny_model(d, **SIZES[size])
    return d


def weights(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def adapter(full: dict[str, torch.Tensor], rank: int, seed: int) -> dict[str, torch.Tensor]:
    """A random adapter on every target of every layer, under the wire contract's names."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in full.items():
        if name.startswith("model.layers.") and name.split(".")[-2] in TARGETS:
            prefix = name.removesuffix(".weight")
            out[f"{prefix}.lora_A.weight"] = 0.01 * torch.randn(rank, w.shape[1], generator=g)
            out[f"{prefix}.lora_B.weight"] = 0.01 * torch.randn(w.shape[0], rank, generator=g)
    return out


def sync_rows(d: Path, full: dict, rank: int, alpha: float, repeat: int) -> dict[str, dict]:
    cfg = WeightsConfig(timeout_s=600.0, overlap=False, verify="off")
    out = {}
    for mode in ("full", "lora"):
        lora = dict(lora_rank=rank, lora_alpha=alpha) if mode == "lora" else {}
        with start_engine_process(d, weight_version="0", timeout_s=600, **lora) as ep:
            b = WeightBroadcaster(cfg, verify=False)
            b.add_generator(wire.GeneratorInfo(url=ep.url, kind="builtin"))
            sync, wall = [], []
            try:
                for v in range(1, repeat + 1):
                    named = adapter(full, rank, seed=v) if mode == "lora" else dict(full)
                    t0 = time.perf_counter()
                    b.publish(v, named, owned=True)
                    wall.append(time.perf_counter() - t0)
                    r = b.reports[-1]
                    assert not r.error and r.updated == [ep.url], r
                    sync.append(r.sync_s)
                    nbytes = r.nbytes
                    del named
            finally:
                b.close()
        out[mode] = {"nbytes": nbytes, "sync_s": min(sync), "publish_s": min(wall)}
        print(f"  {mode}: {out[mode]}", file=sys.stderr, flush=True)
    return out


def median_s(fn, n: int) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.no_grad()
def decode_rows(d: Path, rank: int, alpha: float, batch: int, n: int) -> dict:
    """The engine's decode step (merged weights), the low-rank path's extra ops per step, and
    the merge per version."""
    from transformers import AutoModelForCausalLM

    from asyncrl.engine.batched_model import BatchedLM
    from asyncrl.engine.lora_serving import Adapters, LoraSpec

    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    lm = BatchedLM(hf)
    cache = lm.new_cache(slots=batch)
    lm.prefill(cache, 0, [[5 + i] * 64 for i in range(batch)])
    step = median_s(lambda: lm.decode(cache, [7] * batch, [64] * batch), n)
    params = dict(hf.named_parameters())
    ad = adapter({k: p.data for k, p in params.items()}, rank, seed=0)
    s = alpha / rank
    pairs = []
    for name in sorted(ad):
        if name.endswith(".lora_A.weight"):
            prefix = name.removesuffix(".lora_A.weight")
            pairs.append((ad[name], ad[f"{prefix}.lora_B.weight"]))
    xs = {a.shape[1]: torch.randn(batch, 1, a.shape[1]) for a, _ in pairs}
    outs = [torch.zeros(batch, 1, b.shape[0]) for _, b in pairs]

    def low_rank() -> None:  # what a low-rank path adds to one decode step, every projection
        for (a, b), o in zip(pairs, outs, strict=True):
            o.add_(F.linear(F.linear(xs[a.shape[1]], a), b), alpha=s)

    extra = median_s(low_rank, n)
    store = Adapters(LoraSpec(rank, alpha), params)

    def merge() -> None:  # as the engine's swaps do: into the weights the swap before last freed
        out, served = store.merged(ad, replace=False, dest=lambda *_: None)
        store.served = served
        store.installed(out)

    merge = median_s(merge, max(5, n // 4))
    return {"decode_step_s": step, "low_rank_extra_s": extra, "merge_s": merge, "batch": batch}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="decode steps timed")
    p.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "asyncrl-lora-bench"))
    a = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for size in a.sizes:
        print(f"{size}:", file=sys.stderr, flush=True)
        d = model_dir(size, Path(a.cache))
        full = weights(d)
        sync = sync_rows(d, full, a.rank, a.alpha, a.repeat)
        del full
        dec = decode_rows(d, a.rank, a.alpha, a.batch, a.steps)
        print(f"  decode: {dec}", file=sys.stderr, flush=True)
        rows.append({"size": size, "rank": a.rank, **sync, "decode": dec})
    print(json.dumps({"bench": "lora_sync", "rows": rows}))


if __name__ == "__main__":
    main()
