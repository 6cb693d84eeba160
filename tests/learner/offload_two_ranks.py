"""Run under torchrun with 2 ranks by tests/learner/test_offload.py: the actor's FSDP2 shards,
gradients and AdamW state offloaded and reloaded between two steps on each rank. Writes rank 0's
findings as JSON to ``OUT``: bytes freed on each rank, whether the reload was bitwise, and whether
the second step's weights equal those of a run that did not offload."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402

from asyncrl.learner.offload import Offloader, role_tensors  # noqa: E402
from tests.learner.test_model import make_trainer  # noqa: E402
from tests.learner.test_step import rl_batch  # noqa: E402

RL = {"learner": {"lr": 1e-3, "grad_clip": 1.0}, "buffer": {"max_staleness": 8}}


def run(model: Path, tmp: Path, *, offload: bool) -> tuple[dict, dict[str, torch.Tensor]]:
    tr = make_trainer(model, tmp, **RL)
    vocab = tr.models.spec.model.vocab_size
    tr.step(rl_batch(vocab, seed=0))
    found: dict = {}
    if offload:
        opts = list(tr.models.optimizers)
        before = [t.clone() for t in role_tensors(tr.models.actor, opts)]
        off = Offloader(model=tr.models.actor, optimizers=opts)
        freed = off.offload()
        emptied = all(
            t.untyped_storage().nbytes() == 0 for t in role_tensors(tr.models.actor, opts)
        )
        off.reload()
        after = list(role_tensors(tr.models.actor, opts))
        bitwise = len(after) == len(before) and all(
            torch.equal(a, b) for a, b in zip(after, before, strict=True)
        )
        params = list(tr.models.actor.parameters())
        local = sum(p.to_local().numel() for p in params)
        # FSDP2 pads every rank's shard of a parameter to ceil(rows / ranks) rows (dim 0)
        world = dist.get_world_size()
        padded = sum(-(-p.shape[0] // world) * (p.numel() // p.shape[0]) for p in params)
        found = {
            "freed": freed,
            "emptied": emptied,
            "bitwise": bitwise,
            "local_params": local,
            "padded_params": padded,
            "tensors": len(params),
        }
    tr.step(rl_batch(vocab, seed=1))
    return found, {k: v.clone() for k, v in tr.hf_state_dict().items()}


def main() -> None:
    model, out = Path(sys.argv[1]), Path(sys.argv[2])
    found, offloaded = run(model, out.parent / "with", offload=True)
    _, plain = run(model, out.parent / "without", offload=False)
    found["same_step"] = all(torch.equal(offloaded[k], plain[k]) for k in plain)
    every: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, found)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(every))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
