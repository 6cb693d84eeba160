"""Host memory a role's offloaded states take (``placement.<role>.offload``), by host layout: one
pinned buffer per storage (torch's caching host allocator rounds each up to a power of two), one
pinned buffer for the role (one rounding), and the offloader's: one buffer of the exact size,
page-locked with ``cudaHostRegister`` (asyncrl/learner/offload.py, :func:`host_bytes`).

The storages are those of one FSDP2 rank of N, from the model's real parameter shapes (an HF model
built on the meta device: no weights, no download): per parameter its padded float32 shard
(``ceil(rows / N)`` rows: FSDP2 pads dim 0) and AdamW's two moments of its local shard; per FSDP
unit (TorchTitan's: each block, the embedding, the final norm with the output projection; one unit
with the embedding when tied) one gradient storage, the unit's reduce-scatter output, of which
each gradient is a view. A trained role (actor, critic) offloads all of them, the frozen reference
its shards alone. AdamW's step counters stay on the host (not offloaded on CUDA). The last line
is JSON:

    {"bench": "offload_host", "rows": [{"model", "ranks", "role", "storages", "storage_bytes",
     "per_storage_pinned", "one_pinned", "one_registered"}, ...]}

    python tools/bench/offload_host.py [--ranks 1 8]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from asyncrl.learner.offload import host_bytes  # noqa: E402
from tools.make_tiny_model import FLAVOURS  # noqa: E402


def hf_config(flavour: dict) -> dict:
    """A :data:`FLAVOURS` entry as the config.json keys ``transformers.Qwen3Config`` takes."""
    keys = {
        "hidden": "hidden_size",
        "layers": "num_hidden_layers",
        "heads": "num_attention_heads",
        "kv_heads": "num_key_value_heads",
        "head_dim": "head_dim",
        "intermediate": "intermediate_size",
        "vocab_size": "vocab_size",
        "tie_embeddings": "tie_word_embeddings",
    }
    return {hf: flavour[ours] for ours, hf in keys.items()}


MODELS = {name: hf_config(FLAVOURS[name]) for name in ("qwen3-0.6b", "qwen3-8b")}


def unit_of(name: str) -> str:
    """TorchTitan's FSDP unit of an HF parameter name: its block, else the embedding or the root
    (final norm and output projection)."""
    parts = name.split(".")
    if parts[:2] == ["model", "layers"]:
        return f"block {parts[2]}"
    return "embedding" if "embed_tokens" in name else "root"


def role_storages(config: dict, ranks: int, *, trained: bool) -> list[int]:
    """Bytes of each device storage one of ``ranks`` FSDP2 ranks holds for a role of this model."""
    import torch
    import transformers

    cfg = transformers.Qwen3Config(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    shards: list[int] = []
    units: dict[str, int] = {}
    for name, p in model.named_parameters():  # a tied weight once, in the embedding's unit
        rows = math.ceil(p.shape[0] / ranks)
        nbytes = rows * math.prod(p.shape[1:]) * 4
        shards.append(nbytes)
        units[unit_of(name)] = units.get(unit_of(name), 0) + nbytes
    if not trained:
        return shards
    return shards + list(units.values()) + 2 * shards  # shards, gradients, AdamW moments


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 8])
    a = p.parse_args()
    rows = []
    for model, config in MODELS.items():
        for ranks in a.ranks:
            for role, trained in (("actor", True), ("ref", False)):
                sizes = role_storages(config, ranks, trained=trained)
                row = {"model": model, "ranks": ranks, "role": role, "storages": len(sizes)}
                row |= host_bytes(sizes)
                rows.append(row)
                base = row["storage_bytes"]
                print(
                    f"{model:>10} {ranks} rank(s) {role:>5}: {len(sizes):>5} storages "
                    f"{base / 2**30:6.2f} GiB; host: per-storage pinned "
                    f"{row['per_storage_pinned'] / 2**30:6.2f} GiB "
                    f"({row['per_storage_pinned'] / base:.2f}x), one pinned "
                    f"{row['one_pinned'] / 2**30:6.2f} GiB ({row['one_pinned'] / base:.2f}x), "
                    f"one registered {row['one_registered'] / 2**30:6.2f} GiB "
                    f"({row['one_registered'] / base:.4f}x)",
                    flush=True,
                )
    print(json.dumps({"bench": "offload_host", "rows": rows}))


if __name__ == "__main__":
    main()
