"""Run learner steps on a recorded batch under torchrun and save both trained models.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tests/learner/placement_steps.py RECIPE BATCH OUT_DIR STEPS [RUN_DIR]

Every rank builds the trainer (the recipe's ``placement`` says which ranks hold the actor and the
critic) and steps ``STEPS`` times on the same batch. The actor's first rank writes
``OUT_DIR/actor.safetensors`` (HF names) and ``OUT_DIR/metrics.json`` (every step's metrics, the
same on every rank); the critic's first rank ``OUT_DIR/critic.safetensors`` (its parameters, full);
every rank ``OUT_DIR/roles-rank<r>.json``, the roles whose models it holds. Each model's first
rank also writes ``<model>-start.safetensors`` (the weights before any step),
``<model>-first.safetensors`` and ``<model>-first-grads.safetensors``: the weights
right after the run's first optimizer update and the (clipped) gradient that update used, the one
point where two runs start from the same weights, so that their updates can be compared entry by
entry (tests/numerics.py: never one absolute bound on weights after Adam steps).
With ``RUN_DIR`` the trainer checkpoints there: it resumes the latest checkpoint in it if any, and
after the steps writes a checkpoint and an HF export (``OUT_DIR/hf``).
Used by tests/learner/test_placement.py.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from asyncrl import recipe as recipe_mod
from asyncrl.learner.config import TrainerConfig
from asyncrl.learner.source import decode_batch
from asyncrl.learner.trainer import Trainer
from tests.numerics import full, hf_grads


def after_first_update(optimizers, snapshot: Callable[[], None]) -> None:
    """Call ``snapshot`` once, right after the first ``optimizers.step()`` (a probe of this script:
    the trainer zeroes gradients at the start of an update, so later updates overwrite the first's)."""
    step = optimizers.step

    def first(*args, **kwargs):
        out = step(*args, **kwargs)
        optimizers.step = step
        snapshot()
        return out

    optimizers.step = first


def save_on_leader(leader: bool, tensors: dict, path: Path) -> None:
    if leader:
        save_file({k: v.contiguous() for k, v in tensors.items()}, path)


def main(recipe_path: str, batch_path: str, out_dir: str, steps: str, run_dir: str = "") -> None:
    torch.set_num_threads(1)
    recipe = recipe_mod.load(recipe_path, ["run.resume=true"] if run_dir else [])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(
        TrainerConfig.from_recipe(recipe),
        run_dir=run_dir or out / "run",
        checkpointing=bool(run_dir),
    )
    try:
        batch = decode_batch(Path(batch_path).read_bytes())
        if trainer.models.actor is not None:
            leader = trainer.models.meshes["actor"].leader
            save_on_leader(leader, trainer.hf_state_dict(), out / "actor-start.safetensors")

            def actor_first() -> None:  # both collective over the actor's ranks
                save_on_leader(leader, trainer.hf_state_dict(), out / "actor-first.safetensors")
                save_on_leader(leader, hf_grads(trainer), out / "actor-first-grads.safetensors")

            after_first_update(trainer.models.optimizers, actor_first)
        if trainer.models.critic is not None:
            critic, c_leader = trainer.models.critic.model, trainer.models.meshes["critic"].leader
            start = {n: full(p) for n, p in critic.named_parameters()}
            save_on_leader(c_leader, start, out / "critic-start.safetensors")

            def critic_first() -> None:  # collective over the critic's ranks
                named = list(critic.named_parameters())
                weights = {n: full(p) for n, p in named}
                save_on_leader(c_leader, weights, out / "critic-first.safetensors")
                grads = {n: full(p.grad) for n, p in named}
                save_on_leader(c_leader, grads, out / "critic-first-grads.safetensors")

            after_first_update(trainer.models.critic.optimizers, critic_first)
        metrics = []
        for _ in range(int(steps)):
            res = trainer.step(batch)
            metrics.append({"loss": res.loss, **res.metrics})
        held = {
            "actor": trainer.models.actor,
            "critic": trainer.models.critic,
            "ref": trainer.models.ref,
        }
        roles = sorted(role for role, held_here in held.items() if held_here is not None)
        (out / f"roles-rank{trainer.rank}.json").write_text(json.dumps(roles))
        actor = trainer.hf_state_dict()  # collective over the actor's ranks
        if trainer.models.meshes["actor"].leader:
            save_file({k: v.contiguous() for k, v in actor.items()}, out / "actor.safetensors")
            (out / "metrics.json").write_text(json.dumps(metrics))
        if trainer.models.critic is not None:
            critic = {name: full(p) for name, p in trainer.models.critic.model.named_parameters()}
            save_on_leader(
                trainer.models.meshes["critic"].leader, critic, out / "critic.safetensors"
            )
        if run_dir:
            trainer.save_checkpoint(force=True)
            trainer.export_hf(out / "hf")
    finally:
        trainer.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
