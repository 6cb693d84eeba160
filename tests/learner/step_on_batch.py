"""Run one learner step on a recorded batch, alone or under torchrun, and save what it produced.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/learner/step_on_batch.py \
        RECIPE BATCH OUT_DIR

Every rank builds the trainer and steps on the same batch (``asyncrl.learner.source.encode_batch``
bytes); rank 0 writes ``OUT_DIR/metrics.json`` and ``OUT_DIR/weights.safetensors`` (HF names),
and every rank ``OUT_DIR/kept-rank<r>.json``: what it kept of a rank-0-only bfloat16 gather.
Used by tests/learner/test_distributed.py to compare a multi-rank step with a one-rank step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from asyncrl import recipe as recipe_mod
from asyncrl.learner.source import decode_batch
from asyncrl.learner.trainer import Trainer


def main(recipe_path: str, batch_path: str, out_dir: str) -> None:
    recipe = recipe_mod.load(recipe_path)
    out = Path(out_dir)
    trainer = Trainer(recipe, run_dir=out / "run", checkpointing=False)
    try:
        res = trainer.step(decode_batch(Path(batch_path).read_bytes()))
        weights = trainer.hf_state_dict()  # a collective
        sent = trainer.hf_state_dict(torch.bfloat16, all_ranks=False)  # what a broadcast gathers
        kept = {"tensors": len(sent), "dtypes": sorted({str(t.dtype) for t in sent.values()})}
        (out / f"kept-rank{trainer.rank}.json").write_text(json.dumps(kept))
        if trainer.rank == 0:
            save_file({k: v.contiguous() for k, v in weights.items()}, out / "weights.safetensors")
            (out / "metrics.json").write_text(json.dumps({"loss": res.loss, **res.metrics}))
    finally:
        trainer.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
