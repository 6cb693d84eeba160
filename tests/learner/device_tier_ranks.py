"""Run under torchrun with 2 ranks by tests/learner/test_device_tier.py: one learner step on the
pretend device (:mod:`tests.device_tier`), FSDP2 sharding the actor over gloo (``fsdp``), its LoRA
adapters (``lora``), a bfloat16 mixture of experts with routing replay (``moe``), or one
tensor-parallel group of the two (``tp``), several micro-batches a rank. Rank 0 writes
``OUT/found.json``: each rank's micro-batches and host reads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402

from tests.device_tier import pretend_device  # noqa: E402
from tests.learner.test_model import make_trainer  # noqa: E402
from tests.learner.test_route_checks import routed  # noqa: E402
from tests.learner.test_step import rl_batch  # noqa: E402


def main() -> None:
    model, out, layout = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    # fsdp: the actor sharded over both ranks; tp: one tensor-parallel group of two; lora:
    # FSDP2 over LoRA adapters on a frozen base; moe: a mixture of experts in bfloat16 (the
    # grouped GEMM), its experts sharded, every sample's routes replayed
    learner = {"lr": 1e-3, "grad_clip": 1.0, "micro_batch_tokens": 48}
    if layout == "lora":
        learner["lora"] = {"rank": 4, "alpha": 8.0}
    sections = {
        "tp": {"placement": {r: {"tensor_parallel": 2} for r in ("actor", "ref")}},
        "moe": {"model": {"dtype": "bfloat16"}, "algorithm": {"routing_replay": True}},
    }
    tr = make_trainer(
        model,
        out / "run",
        learner=learner,
        buffer={"max_staleness": 8},
        **sections.get(layout, {}),
    )
    batch = rl_batch(tr.models.spec.model.vocab_size, groups=3, seed=0)
    if layout == "moe":
        routed(batch, np.random.default_rng(0))
    with pretend_device(tr.models) as mode:
        res = tr.step(batch)
    found = {
        "micro_batches": res.metrics["learner/micro_batches"],  # each rank runs as many
        "reads": len(mode.reads),
        "where": [f"{r.name} at {r.where}" for r in mode.reads],
        "loss": res.loss,
        "tp": tr.parallel_dims.tp,
        "routing_agreement": res.metrics.get("learner/routing_agreement"),
    }
    every: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, found)
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "found.json").write_text(json.dumps(every))
    tr.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
