"""Placement: PPO with a critic on 2 ranks, the actor on rank 0 and the critic on rank 1 (disjoint)
against both roles on both ranks (shared), side by side in one run.

One torchrun of 2 CPU ranks builds both learners (each its own meshes) and alternates their steps
on the same batches, so machine load hits both alike. In the disjoint learner, rank 0's
``train_actor`` and rank 1's ``train_critic`` are timed where they run (at the same time); the
disjoint step's wall time over max(actor, critic) says how close it comes to perfect overlap (1:
the step is no longer than its slower train step; the forward passes and the exchange come on top),
over (actor + critic) how much running them at once saves against running them one after the
other (0.5 would be perfect halving when they take equally long). The train level's own wall time
(from the first of the two train steps to start to the last to end) over the same two says how
much the train steps themselves overlap. The last line is JSON:

    {"bench": "placement", "disjoint_over_max": ..., "disjoint_over_sum": ..., ...}

    python tools/bench/bench_placement.py [--steps 6] [--batch 32] [--min-len 32] [--max-len 160]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def make_batch(batch: int, lo: int, hi: int, vocab: int, seed: int):
    """Groups of 4 samples of mixed lengths with rewards, every token trained, version 0."""
    from asyncrl import wire
    from asyncrl.learner.source import Batch

    rng = np.random.default_rng(seed)
    groups = []
    for g in range(batch // 4):
        samples = []
        for i in range(4):
            n = int(rng.integers(lo, hi + 1))
            samples.append(
                wire.Sample(
                    id=f"{seed}-{g}-{i}",
                    group_id=f"{seed}-{g}",
                    prompt_ids=rng.integers(3, vocab, 8).astype(np.int32),
                    completion_ids=rng.integers(3, vocab, n).astype(np.int32),
                    behavior_logprobs=rng.uniform(-5, -3, n).astype(np.float32),
                    versions=np.zeros(n, np.int32),
                    loss_mask=np.ones(n, np.float32),
                    reward=float(rng.integers(0, 2)),
                )
            )
        groups.append(wire.Group(id=f"{seed}-{g}", samples=samples))
    return Batch(groups=groups, version=0, stats={})


def timed(trainer, name: str, into: list[tuple[float, float]]) -> None:
    """Time the dataflow call ``name`` where it runs, for ``trainer`` only (its models; the runner
    table is shared by every trainer of the process): its start and end on the machine's monotonic
    clock, which the two ranks (processes of one host) share."""
    from asyncrl.learner import calls

    run = calls.CALL_RUNNERS[name]
    assert run is not None, name

    def wrapper(models, step_run) -> None:
        t0 = time.perf_counter()
        run(models, step_run)
        if models is trainer.models:
            into.append((t0, time.perf_counter()))

    calls.CALL_RUNNERS[name] = wrapper


def worker(a: argparse.Namespace) -> None:
    import torch.distributed as dist

    from asyncrl import recipe as recipe_mod
    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.trainer import Trainer

    torch.set_num_threads(1)
    tmp = Path(a.tmp)
    spec = {
        "model": {"path": str(tmp / "model"), "max_seq_len": 512},
        "algorithm": {"loss": "ppo", "advantage": "gae"},
        "learner": {"lr": 1e-4, "micro_batch_tokens": a.micro_batch_tokens},
        "buffer": {"max_staleness": a.steps + 2},  # every batch is of version 0
        "run": {"output_dir": str(tmp / "runs")},
    }
    shared = Trainer(
        TrainerConfig.from_recipe(recipe_mod.from_dict(spec)),
        checkpointing=False,
        run_dir=tmp / "shared",
    )
    spec["placement"] = {"actor": {"ranks": [0]}, "critic": {"ranks": [1]}}
    disjoint = Trainer(
        TrainerConfig.from_recipe(recipe_mod.from_dict(spec)),
        checkpointing=False,
        run_dir=tmp / "disjoint",
    )
    actor_s: list[tuple[float, float]] = []
    critic_s: list[tuple[float, float]] = []
    timed(disjoint, "train_actor", actor_s)
    timed(disjoint, "train_critic", critic_s)
    vocab = shared.models.spec.model.vocab_size
    steps: dict[str, list[float]] = {"shared": [], "disjoint": []}
    for i in range(a.steps + 2):
        batch = make_batch(a.batch, a.min_len, a.max_len, vocab, seed=i)
        for name, tr in (("shared", shared), ("disjoint", disjoint)):
            dist.barrier()
            t0 = time.perf_counter()
            tr.step(batch)
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the step ends when its slowest rank does
            if i >= 2:
                steps[name].append(float(t))
    # rank 0 timed the actor's train steps, rank 1 the critic's: every rank gets both, and the
    # train level's wall time per step, from the first of the two to start to the last to end
    n = a.steps + 2
    spans = torch.zeros(2, n, 2, dtype=torch.float64)
    for k, mine in enumerate((actor_s, critic_s)):
        if mine:
            spans[k] = torch.tensor(mine, dtype=torch.float64)
    dist.all_reduce(spans)
    spans = spans[:, 2:]
    if dist.get_rank() == 0:
        actor, critic = (float((s[:, 1] - s[:, 0]).mean()) for s in spans)
        level = (spans[:, :, 1].max(0).values - spans[:, :, 0].min(0).values).mean()
        level = float(level)
        step_d, step_s = statistics.median(steps["disjoint"]), statistics.median(steps["shared"])
        result = {
            "bench": "placement",
            "disjoint_over_max": round(step_d / max(actor, critic), 3),
            "disjoint_over_sum": round(step_d / (actor + critic), 3),
            "disjoint_over_shared": round(step_d / step_s, 3),
            "train_level_over_max": round(level / max(actor, critic), 3),
            "train_level_over_sum": round(level / (actor + critic), 3),
            "train_level_s": round(level, 4),
            "disjoint_step_s": round(step_d, 4),
            "shared_step_s": round(step_s, 4),
            "actor_train_s": round(actor, 4),
            "critic_train_s": round(critic, 4),
            "batch": a.batch,
            "lengths": [a.min_len + 8, a.max_len + 8],
            "steps": a.steps,
        }
        (tmp / "result.json").write_text(json.dumps(result))
    shared.close()
    disjoint.close()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6, help="timed steps per learner (after 2 warm-up)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=160)
    p.add_argument("--micro-batch-tokens", type=int, default=1024)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tmp", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a)
        return 0

    from tools.make_tiny_model import make_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench_placement_"))
    make_tiny_model(tmp / "model", max_positions=512)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [__file__, "--worker", "--tmp", str(tmp), *(argv if argv is not None else sys.argv[1:])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        return proc.returncode
    result = json.loads((tmp / "result.json").read_text())
    print(
        f"shared {result['shared_step_s']:.3f}s  disjoint {result['disjoint_step_s']:.3f}s  "
        f"actor train {result['actor_train_s']:.3f}s  critic train {result['critic_train_s']:.3f}s"
        f"  disjoint/max {result['disjoint_over_max']:.2f}"
        f"  disjoint/sum {result['disjoint_over_sum']:.2f}"
        f"  train level {result['train_level_s']:.3f}s: /max {result['train_level_over_max']:.2f}"
        f"  /sum {result['train_level_over_sum']:.2f}"
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
