"""Run under torchrun with 2 ranks by tests/learner/test_lora.py: LoRA on the actor's FSDP2 shards.
Two steps, then rank 0 writes to ``OUT`` (a folder): ``found.json`` (each rank: its base shards
bitwise unchanged, its adapter shards moved, AdamW state for adapter shards only), the weight
snapshot (``snapshot.safetensors``) and the adapter export (``export/``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tests.learner.test_lora import RL, local, optimizer_state  # noqa: E402
from tests.learner.test_model import make_trainer  # noqa: E402
from tests.learner.test_step import rl_batch  # noqa: E402

STEPS = 2


def main() -> None:
    model, out = Path(sys.argv[1]), Path(sys.argv[2])
    tr = make_trainer(model, out / "run", **RL)
    base, start = local(tr.model, False), local(tr.model, True)
    for _ in range(STEPS):
        tr.step(rl_batch(tr.spec.model.vocab_size, seed=tr.version))
    after_base, after = local(tr.model, False), local(tr.model, True)
    moments = [t for t in optimizer_state(tr) if t.dim() > 0]
    found = {
        "base_unchanged": all(torch.equal(after_base[k], base[k]) for k in base),
        "adapters_moved": all(not torch.equal(after[k], start[k]) for k in start),
        "moment_elements": sum(t.numel() for t in moments),
        "adapter_elements": sum(t.numel() for t in after.values()),
    }
    snapshot = tr.hf_state_dict(all_ranks=False)
    tr.export_hf(out / "export", dtype="float32")
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
