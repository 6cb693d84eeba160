"""Fill π_ref by resharding the actor (a fresh start), and a second π_ref from the HF folder, under
torchrun, and save how they compare.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tests/learner/reshard_ranks.py RECIPE BATCH OUT_DIR

Every rank builds the trainer (its π_ref filled by :func:`asyncrl.learner.reshard.reshard` when it
is on the actor's ranks), then a π_ref in the same layout loaded from ``model.path`` directly. Rank
0 writes ``OUT_DIR/reshard.json``: the trainer's ``ref_source``, the names whose full tensors differ
between the two refs and between the ref and the actor, the bytes a second :func:`reshard` (into the
HF-loaded ref) gathered, and whether the two refs' log π of the batch's trained tokens (this rank's
share) are bitwise equal on every rank. Used by tests/learner/test_reshard.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from asyncrl import recipe as recipe_mod
from asyncrl.learner.config import TrainerConfig
from asyncrl.learner.passes import token_logprobs
from asyncrl.learner.reshard import reshard
from asyncrl.learner.source import decode_batch
from asyncrl.learner.trainer import Trainer


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full tensor (collective over the model's ranks)."""
    return {
        k: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for k, p in model.named_parameters()
    }


def main(recipe_path: str, batch_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    out = Path(out_dir)
    tr = Trainer(
        TrainerConfig.from_recipe(recipe_mod.load(recipe_path)),
        run_dir=out / "run",
        checkpointing=False,
    )
    try:
        ref_mesh = tr.models.meshes["ref"]
        hf_ref = tr.build.model(tr.models.spec, "ref")
        tr.build.load_hf(hf_ref, tr.adapter, tr.model_dir, group=ref_mesh.group)
        hf_ref.eval().requires_grad_(False)
        assert tr.models.ref is not None
        resharded, loaded, actor = _full(tr.models.ref), _full(hf_ref), _full(tr.models.actor)
        differ = sorted(k for k in loaded if not torch.equal(resharded[k], loaded[k]))
        differ_actor = sorted(k for k in actor if not torch.equal(resharded[k], actor[k]))

        seqs = ref_mesh.share(tr.sequences(decode_batch(Path(batch_path).read_bytes())))
        mbs = tr.micro_batches(seqs, ref_mesh.group)
        lp_re = torch.cat([token_logprobs(tr.models, mb, tr.models.ref)[0] for mb in mbs])
        lp_hf = torch.cat([token_logprobs(tr.models, mb, hf_ref)[0] for mb in mbs])
        same = torch.tensor([float(torch.equal(lp_re, lp_hf)), float(lp_re.numel())])
        dist.all_reduce(same)  # every rank's share: equal everywhere, tokens counted per rank

        # once more, into the HF-loaded ref: the bytes, and the copy is a no-op on equal weights
        moved = reshard(tr.models.actor, hf_ref)
        again = _full(hf_ref)
        differ_again = sorted(k for k in loaded if not torch.equal(again[k], loaded[k]))
        if tr.rank == 0:
            report = {
                "ref_source": tr.ref_source,
                "differ": differ,
                "differ_actor": differ_actor,
                "differ_after_second": differ_again,
                "names": len(loaded),
                "bytes": moved,
                "model_bytes": sum(t.numel() * t.element_size() for t in loaded.values())
                + sum(b.numel() * b.element_size() for b in hf_ref.buffers()),  # RoPE's cache
                "logprobs_equal_ranks": int(same[0]),
                "logprobs_tokens": int(same[1]),
            }
            (out / "reshard.json").write_text(json.dumps(report))
    finally:
        tr.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
