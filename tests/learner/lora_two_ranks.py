"""Run under torchrun with 2 (or 4) ranks by tests/learner/test_lora.py: LoRA on the actor's FSDP2
shards, with ``TP`` (the third argument, default 1) tensor-parallel ranks per group. Two steps, then rank
0 writes to ``OUT`` (a folder): ``found.json`` (each rank: its base shards bitwise unchanged, its
adapter shards moved, AdamW state for adapter shards only, each step's loss and metrics, and
whether a checkpoint of them resumes to the same shards and AdamW state), the weight snapshot
(``snapshot.safetensors``), the adapter export (``export/``) and the merged export
(``merged/``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from asyncrl import recipe as recipe_mod  # noqa: E402
from asyncrl.learner.config import TrainerConfig  # noqa: E402
from asyncrl.learner.trainer import Trainer  # noqa: E402
from tests.learner.test_lora import TWO_RANKS, local, optimizer_state  # noqa: E402
from tests.learner.test_step import rl_batch  # noqa: E402

STEPS = 2


def trainer(model: Path, out: Path, tp: int) -> Trainer:
    """test_model.make_trainer's trainer, with checkpoints (a second one resumes the first)."""
    data = {
        "model": {"path": str(model), "max_seq_len": 256},
        "run": {"output_dir": str(out), "name": "lora", "resume": True},
        "placement": {"actor": {"tensor_parallel": tp}},
    } | TWO_RANKS
    return Trainer(TrainerConfig.from_recipe(recipe_mod.from_dict(data)))


def main() -> None:
    model, out = Path(sys.argv[1]), Path(sys.argv[2])
    tp = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    tr = trainer(model, out / "run", tp)
    base, start = local(tr.models.actor, False), local(tr.models.actor, True)
    steps = []
    for _ in range(STEPS):
        res = tr.step(rl_batch(tr.models.spec.model.vocab_size, seed=tr.version))
        steps.append({"loss": res.loss, **res.metrics})
    after_base, after = local(tr.models.actor, False), local(tr.models.actor, True)
    moments = [t for t in optimizer_state(tr) if t.dim() > 0]
    found = {
        "base_unchanged": all(torch.equal(after_base[k], base[k]) for k in base),
        "adapters_moved": all(not torch.equal(after[k], start[k]) for k in start),
        "moment_elements": sum(t.numel() for t in moments),
        "adapter_elements": sum(t.numel() for t in after.values()),
        "steps": steps,
    }
    snapshot = tr.hf_state_dict(all_ranks=False)
    tr.export_hf(out / "export", dtype="float32")
    tr.config.learner.lora.export = "merged"
    tr.export_hf(out / "merged", dtype="float32")
    assert tr.save_checkpoint(force=True)
    tr.wait_for_checkpoint()
    state = optimizer_state(tr)
    tr.close()
    again = trainer(model, out / "run", tp)
    got, got_state = local(again.models.actor, True), optimizer_state(again)
    found["resumed"] = (
        again.version == STEPS
        and got.keys() == after.keys()
        and all(torch.equal(got[k], after[k]) for k in got)
        and len(got_state) == len(state)
        and all(torch.equal(a, b) for a, b in zip(got_state, state, strict=True))
    )
    again.close()
    every: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, found)
    if dist.get_rank() == 0:
        save_file(
            {k: v.contiguous() for k, v in snapshot.items()}, str(out / "snapshot.safetensors")
        )
        (out / "found.json").write_text(json.dumps(every))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
