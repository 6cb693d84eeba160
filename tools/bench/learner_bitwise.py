"""The learner's results, hashed: a refactor of the step machinery must leave every parameter bitwise
the same. Run it with the reference checkout first and with the changed one second, and compare.

    PYTHONPATH=REF python tools/bench/learner_bitwise.py WORK_DIR > ref.txt
    PYTHONPATH=NEW python tools/bench/learner_bitwise.py WORK_DIR > new.txt
    diff ref.txt new.txt

Four runs on a tiny random Qwen3 (made in ``WORK_DIR/model`` with a fixed seed), three steps each
on random batches, float32 on CPU:

- ``grpo-minibatches``: GRPO advantages, ``decoupled_ppo`` with ``learner.minibatches 2`` (π_prox
  recomputed), one rank;
- ``ppo-critic-kl``: PPO with a critic (``advantage gae``) and a KL reference (``kl_coef > 0``), one
  rank;
- ``grpo-2ranks``: the first on 2 gloo ranks under torchrun, with several micro-batches a rank
  (a small ``learner.micro_batch_tokens``);
- ``reward-model-2ranks``: ``algorithm.loss reward_model`` (a new scalar head on the same model,
  Bradley–Terry on random pairs) on 2 gloo ranks, several micro-batches a rank.

Prints, per run, a sha256 of every parameter of the actor (HF names) and of the critic, and one of
each step's loss and metrics (the timing and memory ones left out).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
BASE = {
    "learner": {"lr": 1e-3, "grad_clip": 1.0, "checkpoint_every": 0},
    "buffer": {"max_staleness": 8},
}
RUNS: dict[str, dict] = {
    "grpo-minibatches": {
        "algorithm": {"advantage": "grpo", "loss": "decoupled_ppo"},
        "learner": {"minibatches": 2},
    },
    "ppo-critic-kl": {
        "algorithm": {"advantage": "gae", "loss": "ppo", "kl_coef": 0.05},
        "critic": {"lr": 3e-3},
    },
    "grpo-2ranks": {
        "algorithm": {"advantage": "grpo", "loss": "decoupled_ppo"},
        "learner": {"minibatches": 2, "micro_batch_tokens": 48},
    },
    "reward-model-2ranks": {  # groups of two: (chosen, rejected) pairs
        "algorithm": {"loss": "reward_model"},
        "learner": {"micro_batch_tokens": 48},
    },
}
RANKS = {"grpo-2ranks": 2, "reward-model-2ranks": 2}
GROUP_SIZE = {"reward-model-2ranks": 2}
UNSTABLE = ("step_s", "per_s", "max_rss", "max_allocated")  # time and memory: not results


def batch(vocab: int, seed: int, n: int = 4):
    """Random groups of ``n`` samples at version 0 (noisy behaviour logprobs, rewards 0/1 + 0.1·i)."""
    from asyncrl import wire
    from asyncrl.learner.source import Batch

    rng = np.random.default_rng(seed)
    groups = []
    for g in range(3):
        prompt = rng.integers(3, vocab, size=int(rng.integers(3, 9))).astype(np.int32)
        samples = []
        for i in range(n):
            c = rng.integers(3, vocab, size=int(rng.integers(2, 12))).astype(np.int32)
            blp = (np.log(1.0 / vocab) + rng.normal(0, 0.1, len(c))).astype(np.float32)
            samples.append(
                wire.Sample(
                    id=f"{g}-{i}",
                    group_id=str(g),
                    prompt_ids=prompt,
                    completion_ids=c,
                    behavior_logprobs=blp,
                    versions=np.zeros(len(c), np.int32),
                    loss_mask=np.ones(len(c), np.float32),
                    reward=float(rng.integers(0, 2)) + 0.1 * i,
                )
            )
        groups.append(wire.Group(id=str(g), samples=samples))
    return Batch(groups=groups, version=0, stats={"staleness_mean": 0.0})


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()[:16]


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def run(name: str, work: Path) -> None:
    """One run on this process's rank(s); rank 0 prints its lines."""
    import torch.distributed as dist

    from asyncrl import recipe as recipe_mod
    from asyncrl.learner.trainer import Trainer

    try:  # before the learner's split (f9c98c7) the reward model's learner was a subclass
        from asyncrl.learner.reward_model import RewardModelTrainer
    except ImportError:
        RewardModelTrainer = Trainer  # noqa: N806
    try:  # after cd8c995 the Trainer takes its TrainerConfig, not the recipe
        from asyncrl.learner.config import TrainerConfig

        inputs = TrainerConfig.from_recipe
    except ImportError:
        inputs = None

    data = {
        "model": {"path": str(work / "model"), "max_seq_len": 256},
        "run": {"output_dir": str(work / "runs"), "name": name, "seed": 0},
    }
    for spec in (BASE, RUNS[name]):
        for k, v in spec.items():
            data.setdefault(k, {}).update(v)
    torch.manual_seed(0)
    learner = RewardModelTrainer if name.startswith("reward-model") else Trainer
    r = recipe_mod.from_dict(data)
    tr = learner(inputs(r) if inputs is not None else r, checkpointing=False)
    lines = []
    vocab = tr.models.spec.model.vocab_size
    for step in range(STEPS):
        res = tr.step(batch(vocab, seed=step, n=GROUP_SIZE.get(name, 4)))
        metrics = {k: v for k, v in res.metrics.items() if not any(u in k for u in UNSTABLE)}
        text = json.dumps({"loss": res.loss, **metrics}, sort_keys=True)
        lines.append(f"{name} step {step} metrics {hashlib.sha256(text.encode()).hexdigest()[:16]}")
    actor = tr.hf_state_dict()
    critic = {}
    if tr.models.critic is not None:
        critic = {k: full(v) for k, v in tr.models.critic.model.state_dict().items()}
    if tr.rank == 0:
        lines += [f"{name} actor {k} {digest(v)}" for k, v in sorted(actor.items())]
        lines += [f"{name} critic {k} {digest(v)}" for k, v in sorted(critic.items())]
        print("\n".join(lines), flush=True)
    tr.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def main(work: Path) -> None:
    import asyncrl
    from tools.make_tiny_model import make_tiny_model

    print(f"# asyncrl from {Path(asyncrl.__file__).parent}", file=sys.stderr)
    if not (work / "model").is_dir():
        make_tiny_model(work / "model", arch="qwen3")
    for name in RUNS:
        ranks = RANKS.get(name, 1)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", str(ranks), __file__, "one", name, str(work)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            sys.exit(f"{name} failed:\n{out.stderr[-4000:]}")
        print(out.stdout, end="", flush=True)


if __name__ == "__main__":
    sys.path.append(str(ROOT))  # tools/, after PYTHONPATH: its asyncrl is the one measured
    if len(sys.argv) == 4 and sys.argv[1] == "one":  # one run, on each torchrun rank
        torch.set_num_threads(1)
        run(sys.argv[2], Path(sys.argv[3]))
    else:
        p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        p.add_argument("work_dir", type=Path, help="where the tiny model and the runs' files go")
        main(p.parse_args().work_dir)
