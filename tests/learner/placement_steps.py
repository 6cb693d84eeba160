"""Run learner steps on a recorded batch under torchrun and save both trained models.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tests/learner/placement_steps.py RECIPE BATCH OUT_DIR STEPS [RUN_DIR]

Every rank builds the trainer (the recipe's ``placement`` says which ranks hold the actor and the
critic) and steps ``STEPS`` times on the same batch. The actor's first rank writes
``OUT_DIR/actor.safetensors`` (HF names) and ``OUT_DIR/metrics.json`` (every step's metrics, the
same on every rank); the critic's first rank ``OUT_DIR/critic.safetensors`` (its parameters, full);
every rank ``OUT_DIR/roles-rank<r>.json``, the roles whose models it holds.
With ``RUN_DIR`` the trainer checkpoints there: it resumes the latest checkpoint in it if any, and
after the steps writes a checkpoint and an HF export (``OUT_DIR/hf``).
Used by tests/learner/test_placement.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from asyncrl import recipe as recipe_mod
from asyncrl.learner.source import decode_batch
from asyncrl.learner.trainer import Trainer


def main(recipe_path: str, batch_path: str, out_dir: str, steps: str, run_dir: str = "") -> None:
    torch.set_num_threads(1)
    recipe = recipe_mod.load(recipe_path, ["run.resume=true"] if run_dir else [])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(recipe, run_dir=run_dir or out / "run", checkpointing=bool(run_dir))
    try:
        batch = decode_batch(Path(batch_path).read_bytes())
        metrics = []
        for _ in range(int(steps)):
            res = trainer.step(batch)
            metrics.append({"loss": res.loss, **res.metrics})
        held = {"actor": trainer.model, "critic": trainer.critic, "ref": trainer.ref_model}
        roles = sorted(role for role, held_here in held.items() if held_here is not None)
        (out / f"roles-rank{trainer.rank}.json").write_text(json.dumps(roles))
        actor = trainer.hf_state_dict()  # collective over the actor's ranks
        if trainer.meshes["actor"].leader:
            save_file({k: v.contiguous() for k, v in actor.items()}, out / "actor.safetensors")
            (out / "metrics.json").write_text(json.dumps(metrics))
        if trainer.critic is not None:
            critic = {
                name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().contiguous()
                for name, p in trainer.critic.model.named_parameters()
            }
            if trainer.meshes["critic"].leader:
                save_file(critic, out / "critic.safetensors")
        if run_dir:
            trainer.save_checkpoint(force=True)
            trainer.export_hf(out / "hf")
    finally:
        trainer.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
