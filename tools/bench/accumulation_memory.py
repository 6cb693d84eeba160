"""Gradient memory of gradient accumulation on 2 FSDP2 ranks (gloo, CPU): one learner step on the same
batch in 1 micro-batch against 4, side by side.

FSDP2 holds a parameter's gradient unsharded (all of it, float32 here) until it reduce-scatters it;
it reduce-scatters at a backward only when gradient sync is on. With sync off for all but the last
micro-batch, every rank keeps the whole model's unsharded gradient, 4·P bytes, from the first
micro-batch to the last; with sync on each micro-batch leaves only the sharded sum, 4·P/N.

Per rank it measures, on the second step (the first allocates AdamW's state): the unsharded gradient
bytes FSDP2 holds when each training forward starts (:func:`held_at_each_forward`: what a micro-batch
leaves to the next), and the step's peak resident memory over the resident memory before it (glibc
returning large frees, ``MALLOC_MMAP_THRESHOLD_``, as in tools/bench/logprob_memory.py). The last line
is JSON:

    {"bench": "accumulation_memory", "params": ..., "rows": [{"micro_batches", "rank", ...}]}

    python tools/bench/accumulation_memory.py [--hidden 512] [--layers 8] [--vocab 4096] [--tokens 480]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

SEQ = 64  # tokens per sample: a 4-token prompt and 60 trained tokens


def unsharded_grad_bytes(model: torch.nn.Module) -> int:
    """Bytes of gradient FSDP2 holds unsharded on this rank: each parameter's unsharded copy's
    ``.grad`` (autograd's, before a reduce-scatter) and the reduce-dtype sum a backward without
    gradient sync keeps for the next one (``unsharded_accumulated_grad``)."""
    from torch.distributed.fsdp import FSDPModule

    held: dict[int, int] = {}  # by FSDPParam: a grouped unit is every one of its modules' state
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        for group in m._get_fsdp_state()._fsdp_param_groups:
            for fp in group.fsdp_params:
                grads = [fp.unsharded_accumulated_grad, getattr(fp, "_unsharded_param", None)]
                grads[1] = grads[1].grad if grads[1] is not None else None
                held[id(fp)] = sum(g.numel() * g.element_size() for g in grads if g is not None)
    return sum(held.values())


@contextmanager
def held_at_each_forward(models: Sequence[torch.nn.Module]) -> Iterator[list[int]]:
    """The unsharded gradient bytes of ``models`` when each training (grad-enabled) forward of one
    of them starts: what the micro-batches before it left behind."""
    seen: list[int] = []

    def hook(_module: torch.nn.Module, _args: tuple) -> None:
        if torch.is_grad_enabled():
            seen.append(sum(unsharded_grad_bytes(m) for m in models))

    handles = [m.register_forward_pre_hook(hook) for m in models]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def worker(model_dir: str, tokens: int, micro_batches: int, out: str) -> None:
    """One rank (under torchrun): two steps on ``tokens`` trained tokens per rank in
    ``micro_batches`` micro-batches; writes the second step's measures to ``out/rank<r>.json``."""
    import numpy as np
    import torch.distributed as dist

    from asyncrl import memory
    from asyncrl import recipe as recipe_mod
    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.logprobs import chunk_tokens
    from asyncrl.learner.trainer import Trainer
    from tools.bench.logprob_memory import rl_batch

    torch.set_num_threads(1)
    per_rank = tokens // (SEQ - 4)
    recipe = recipe_mod.from_dict(
        {
            "model": {"path": model_dir, "max_seq_len": SEQ},
            "algorithm": {"loss": "tis"},
            "learner": {"lr": 1e-4, "micro_batch_tokens": per_rank * SEQ // micro_batches},
            "buffer": {"max_staleness": 4},
            "run": {"output_dir": tempfile.mkdtemp()},
        }
    )
    trainer = Trainer(TrainerConfig.from_recipe(recipe), checkpointing=False)
    try:
        vocab = trainer.models.spec.model.vocab_size
        rng = np.random.default_rng(0)
        n = per_rank * dist.get_world_size()
        trainer.step(rl_batch(vocab, n, SEQ - 4, prompt_len=4, rng=rng))  # AdamW's state
        trainer.version = 0
        batch = rl_batch(vocab, n, SEQ - 4, prompt_len=4, rng=rng, tag="b")
        Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to now
        before = _status_kib("VmRSS")
        with held_at_each_forward([trainer.models.actor]) as held:
            res = trainer.step(batch)
        peak = _status_kib("VmHWM")
        params = list(trainer.models.actor.parameters())
        dims = memory.ModelDims.from_hf_config(
            json.loads(Path(model_dir, "config.json").read_text())
        )
        lc = recipe.learner
        plan = memory.learner_plan(
            dims,
            ranks=dist.get_world_size(),
            compute_dtype=recipe.model.dtype,
            micro_batch_tokens=lc.micro_batch_tokens,
            max_seq_len=recipe.model.max_seq_len,
            checkpointing=lc.activation_checkpointing,
            chunk_tokens=chunk_tokens(dims.vocab, lc.logits_chunk_mb),
        )
        sharded = sum(p.grad.to_local().nbytes for p in params if p.grad is not None)
        row = {
            "rank": trainer.rank,
            "micro_batches": int(res.metrics["learner/micro_batches"]),
            "params": sum(p.numel() for p in params),
            "held_mib": max(held) / 2**20,
            "grads_mib": sharded / 2**20,
            "plan_grads_mib": plan.grads / 2**20,
            "peak_mib": (peak - before) / 1024,
        }
        Path(out, f"rank{trainer.rank}.json").write_text(json.dumps(row))
    finally:
        trainer.close()
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=480, help="trained tokens per rank")
    p.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.worker[0], int(a.worker[1]), int(a.worker[2]), a.worker[3])
        return

    from tools.make_tiny_model import make_tiny_model

    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MALLOC_MMAP_THRESHOLD_": "131072",
        "PYTHONPATH": str(ROOT),
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(
            Path(tmp) / "model",
            hidden=a.hidden,
            layers=a.layers,
            heads=8,
            kv_heads=4,
            intermediate=4 * a.hidden,
            vocab_size=a.vocab,
            max_positions=SEQ,
        )
        for mbs in (1, 4):
            out = Path(tmp) / f"mb{mbs}"
            out.mkdir()
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            cmd += ["--nproc-per-node", "2", __file__, "--worker"]
            cmd += [str(model), str(a.tokens), str(mbs), str(out)]
            subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            for r in range(2):
                row = json.loads((out / f"rank{r}.json").read_text())
                rows.append(row)
                print(
                    f"{row['micro_batches']} micro-batch(es), rank {r}: unsharded gradient held "
                    f"between micro-batches {row['held_mib']:6.1f} MiB, sharded gradient "
                    f"{row['grads_mib']:5.1f} MiB (plan {row['plan_grads_mib']:5.1f}), "
                    f"step peak over start {row['peak_mib']:6.1f} MiB",
                    flush=True,
                )
    params = rows[0]["params"]
    print(f"{params / 1e6:.1f}M parameters: 4·P = {4 * params / 2**20:.1f} MiB")
    print(json.dumps({"bench": "accumulation_memory", "params": params, "rows": rows}))


if __name__ == "__main__":
    main()
