"""Run one learner step on a recorded batch, alone or under torchrun, and save what it produced.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/learner/step_on_batch.py \
        RECIPE BATCH OUT_DIR [--before] [--grads] [--export]

Every rank builds the trainer and steps on the same batch (``asyncrl.learner.source.encode_batch``
bytes); rank 0 writes ``OUT_DIR/metrics.json`` and ``OUT_DIR/weights.safetensors`` (HF names),
and every rank ``OUT_DIR/kept-rank<r>.json``: what it kept of a rank-0-only bfloat16 gather.
``--before``: also ``logprobs.safetensors`` (log π of the batch's trained tokens),
``before.safetensors`` (the weights) and ``sent.safetensors`` (a bfloat16 broadcast's rank-0
gather) before the step; ``--grads``: ``grads.safetensors`` after it; ``--export``: an HF export in ``OUT_DIR/export``.
Used by tests/learner/test_distributed.py to compare a multi-rank step with a one-rank step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from asyncrl import recipe as recipe_mod
from asyncrl import wire
from asyncrl.learner.config import TrainerConfig
from asyncrl.learner.source import decode_batch
from asyncrl.learner.trainer import Trainer
from tests.numerics import hf_grads


def torchrun(ranks: int = 2) -> list[str]:
    """torchrun with ``ranks`` local ranks (gloo on CPU); the script or ``-m module`` and its
    arguments follow."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
    ]


def random_sample(i: int, n: int, trained: bool) -> wire.Sample:
    """Sample ``i`` of group ``g``: a 5-token prompt, ``n`` completion tokens (all trained, or none:
    e.g. all tool output) sampled at version 0, reward ``i``; its tokens from seed ``i``."""
    rng = np.random.default_rng(i)
    return wire.Sample(
        id=f"s{i}",
        group_id="g",
        prompt_ids=rng.integers(3, 90, 5).astype(np.int32),
        completion_ids=rng.integers(3, 90, n).astype(np.int32),
        behavior_logprobs=np.full(n, -4.5, np.float32),
        versions=np.zeros(n, np.int32),
        loss_mask=np.full(n, float(trained), np.float32),
        reward=float(i),
    )


def run_ranks(
    recipe: Path, batch: Path, out: Path, *flags: str, ranks: int = 2, timeout: float = 300
) -> subprocess.CompletedProcess:
    """This script on ``ranks`` ranks under torchrun (gloo), one thread each."""
    cmd = [*torchrun(ranks), __file__, str(recipe), str(batch), str(out), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)


def main(recipe_path: str, batch_path: str, out_dir: str, *flags: str) -> None:
    recipe = recipe_mod.load(recipe_path)
    out = Path(out_dir)
    trainer = Trainer(TrainerConfig.from_recipe(recipe), run_dir=out / "run", checkpointing=False)
    try:
        batch = decode_batch(Path(batch_path).read_bytes())
        if "--before" in flags:  # log π of every trained token and the weights, before the step
            seqs = trainer.sequences(batch)
            lp = torch.cat(trainer.logprobs(trainer.micro_batches(seqs)))  # every rank: all
            before = trainer.hf_state_dict()
            sent = trainer.hf_state_dict(torch.bfloat16, all_ranks=False)  # a broadcast's
            if trainer.rank == 0:
                _save({"logp": lp}, out / "logprobs.safetensors")
                _save(before, out / "before.safetensors")
                _save(sent, out / "sent.safetensors")
        res = trainer.step(batch)
        weights = trainer.hf_state_dict()  # a collective
        sent = trainer.hf_state_dict(torch.bfloat16, all_ranks=False)  # what a broadcast gathers
        kept = {"tensors": len(sent), "dtypes": sorted({str(t.dtype) for t in sent.values()})}
        (out / f"kept-rank{trainer.rank}.json").write_text(json.dumps(kept))
        if trainer.rank == 0:
            _save(weights, out / "weights.safetensors")
            (out / "metrics.json").write_text(json.dumps({"loss": res.loss, **res.metrics}))
        if "--grads" in flags:  # the step's (clipped) gradients, under HF names
            grads = hf_grads(trainer)
            if trainer.rank == 0:
                _save(grads, out / "grads.safetensors")
        if "--export" in flags:
            trainer.export_hf(out / "export")
    finally:
        trainer.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
