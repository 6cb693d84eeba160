"""Learner roles on their own ranks (the recipe's ``placement``; asyncrl/learner/placement.py).

Two real ranks under torchrun (gloo, FSDP2, TorchTitan): PPO with a critic (GAE and a KL-shaped
reward, two epochs) with the actor on rank 0 and the critic on rank 1 trains both models to what
both roles on both ranks do; the values and the reference logprobs cross between the roles; a
checkpoint of that placement resumes bitwise and its export holds the actor. Also which keys cross
before which call, and the one-line errors for placements the learner refuses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from asyncrl import dataflow, wire
from asyncrl.learner.placement import exchanges, role_layouts
from asyncrl.learner.source import Batch, encode_batch
from asyncrl.recipe import PlacementConfig, RecipeError, RolePlacement, check_placement
from tests.numerics import (
    GRAD_RTOL,
    assert_adam_steps_agree,
    assert_close_rel,
    assert_grads_close,
)

STEPS = 2

DISJOINT = {"actor": {"ranks": [0]}, "critic": {"ranks": [1]}}

LR = 1e-3

METRIC_RTOL = GRAD_RTOL
"""Every step's loss, gradient norms and value loss, disjoint against shared: float32 sums over a
few hundred tokens added in another order (one rank's micro-batches against two ranks'
reduce-scatter; the whitening's sums over the batch against two shares' all-reduce). Measured on a
2-core AMD EPYC (the first step's loss): 3.7e-7 relative on its AVX-512 kernels, 2.0e-6 with
``ATEN_CPU_CAPABILITY=avx2`` (the old bound, 1e-6, failed there). The second step starts from weights
that already differ where Adam amplified rounding (below), so its metrics get the gradients' bound,
not the first step's measured figure."""

DRIFT_RTOL = 1e-2
"""After all the steps, ‖w_disjoint − w_shared‖ ≤ DRIFT_RTOL · ‖w_shared − w_start‖ per model: the
runs may differ only at the few entries whose gradient is within rounding of 0 (Adam moves those by
up to 2·lr in either direction; tests/numerics.py), a vanishing share of the whole update's norm. A
wrong split, exchange or normaliser moves most entries by about lr: a ratio near 1. Measured
(AMD EPYC): ≤ 3.8e-6 on its AVX-512 and generic kernels, 1.2e-5 with ``ATEN_CPU_CAPABILITY=avx2``,
where one actor entry ends 1.48e-5 (0.015·lr) apart: the old absolute bound, 0.01·lr, failed there."""


def ppo_batch() -> Batch:
    """Two groups of three samples of uneven lengths, one with a tool output (mask 0) inside."""
    samples = []
    for i in range(6):
        rng = np.random.default_rng(i)
        n = 6 + 5 * i
        mask = np.ones(n, np.float32)
        if i == 3:
            mask[4:8] = 0.0
        samples.append(
            wire.Sample(
                id=f"s{i}",
                group_id=f"g{i // 3}",
                prompt_ids=rng.integers(3, 90, 5).astype(np.int32),
                completion_ids=rng.integers(3, 90, n).astype(np.int32),
                behavior_logprobs=rng.uniform(-5.0, -3.0, n).astype(np.float32),
                versions=np.zeros(n, np.int32),
                loss_mask=mask,
                reward=float(i % 3),
            )
        )
    groups = [wire.Group(id=f"g{g}", samples=samples[3 * g : 3 * g + 3]) for g in range(2)]
    return Batch(groups=groups, version=0, stats={})


def torchrun_steps(
    recipe: Path, batch: Path, out: Path, steps: int = STEPS, run_dir: Path | None = None
) -> subprocess.Popen:
    """``steps`` learner steps on ``batch`` on 2 ranks (tests/learner/placement_steps.py); with
    ``run_dir``, checkpointed there (resumed from it when it holds one) and exported."""
    script = Path(__file__).with_name("placement_steps.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(script), str(recipe), str(batch), str(out), str(steps)]
    cmd += [str(run_dir)] if run_dir is not None else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    return subprocess.Popen(
        cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    )


def finish(procs: dict[str, subprocess.Popen]) -> None:
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name}: {err[-3000:]}"


def ppo_recipe(tmp_path: Path, model: Path, placement: dict | None) -> Path:
    spec = {
        "run": {"output_dir": str(tmp_path / "runs")},
        "model": {"path": str(model), "max_seq_len": 64},
        "algorithm": {"loss": "ppo", "advantage": "gae", "kl_reward_coef": 0.1},
        "learner": {"lr": LR, "micro_batch_tokens": 48, "epochs": 2},
        "buffer": {"max_staleness": STEPS},
        "logging": {"wandb": False},
    }
    if placement is not None:
        spec["placement"] = placement
    name = "disjoint" if placement else "shared"
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture(scope="module")
def runs(tiny_qwen3, tmp_path_factory) -> Path:
    """Both roles on both ranks, 2 steps; actor on rank 0 and critic on rank 1, 2 steps; the same
    placement 1 step, checkpoint and export, then a new learner resuming it for the second step."""
    root = tmp_path_factory.mktemp("placement")
    batch = root / "batch.bin"
    batch.write_bytes(encode_batch(ppo_batch()))
    shared, disjoint = (ppo_recipe(root, tiny_qwen3, p) for p in (None, DISJOINT))
    finish(
        {
            "shared": torchrun_steps(shared, batch, root / "shared"),
            "disjoint": torchrun_steps(disjoint, batch, root / "disjoint"),
            "first": torchrun_steps(disjoint, batch, root / "first", 1, root / "run"),
        }
    )
    finish({"resumed": torchrun_steps(disjoint, batch, root / "resumed", 1, root / "run")})
    return root


@pytest.mark.numerics
@pytest.mark.slow
def test_actor_and_critic_on_their_own_ranks_train_as_on_shared_ranks(runs):
    def roles(run: str, rank: int) -> list[str]:
        return json.loads((runs / run / f"roles-rank{rank}.json").read_text())

    assert roles("shared", 0) == roles("shared", 1) == ["actor", "critic", "ref"]
    # a rank outside a role holds no model of it; the ref follows the actor
    assert (roles("disjoint", 0), roles("disjoint", 1)) == (["actor", "ref"], ["critic"])

    def weights(run: str, name: str) -> dict[str, torch.Tensor]:
        return load_file(str(runs / run / f"{name}.safetensors"))

    for model in ("actor", "critic"):
        # the first update starts from the same weights: the same gradient up to float32
        # reordering, and so the same Adam step wherever that gradient is clearly non-zero
        grads = weights("shared", f"{model}-first-grads")
        assert_grads_close(grads, weights("disjoint", f"{model}-first-grads"))
        first = weights("shared", f"{model}-first")
        assert_adam_steps_agree(first, weights("disjoint", f"{model}-first"), grads, lr=LR)
        # the whole run: the two end points apart by a vanishing share of the distance trained
        start = weights("shared", f"{model}-start")
        assert all(
            torch.equal(w, weights("disjoint", f"{model}-start")[k]) for k, w in start.items()
        )
        start = {k: w.double() for k, w in start.items()}
        shared, disjoint = weights("shared", model), weights("disjoint", model)
        assert set(shared) == set(disjoint) == set(start)
        apart = sum(
            float((shared[k].double() - disjoint[k].double()).square().sum()) for k in start
        )
        moved = sum(float((shared[k].double() - start[k]).square().sum()) for k in start)
        assert moved > 0 and apart**0.5 <= DRIFT_RTOL * moved**0.5, (model, apart**0.5, moved**0.5)
    shared_m = json.loads((runs / "shared" / "metrics.json").read_text())
    disjoint_m = json.loads((runs / "disjoint" / "metrics.json").read_text())
    assert len(shared_m) == len(disjoint_m) == STEPS
    for a, b in zip(shared_m, disjoint_m, strict=True):
        for key in ("loss", "grad_norm", "critic/value_loss", "critic/grad_norm"):
            assert_close_rel(a[key], b[key], rtol=METRIC_RTOL)
        assert a["loss/tokens"] == b["loss/tokens"]


@pytest.mark.numerics
def test_roles_on_their_own_ranks_checkpoint_resume_and_export_bitwise(runs):
    """Each rank saves the states of the roles it holds into one DCP checkpoint (the actor's from
    rank 0, the critic's from rank 1) and reads them back; the resumed step is the uninterrupted
    run's second, bitwise. The HF export of the actor holds the weights the actor trained."""
    assert (runs / "run" / "checkpoints" / "step-1" / ".metadata").is_file()
    for model in ("actor", "critic"):
        a = load_file(str(runs / "disjoint" / f"{model}.safetensors"))
        b = load_file(str(runs / "resumed" / f"{model}.safetensors"))
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), model
    whole = json.loads((runs / "disjoint" / "metrics.json").read_text())
    resumed = json.loads((runs / "resumed" / "metrics.json").read_text())
    assert resumed[0]["loss"] == whole[1]["loss"]
    assert resumed[0]["critic/value_loss"] == whole[1]["critic/value_loss"]
    exported = load_file(str(runs / "first" / "hf" / "model-00001-of-00001.safetensors"))
    trained = load_file(str(runs / "first" / "actor.safetensors"))
    assert set(exported) == set(trained)
    assert all(torch.equal(exported[k], trained[k]) for k in trained)


def test_which_keys_cross_between_roles_before_which_call():
    flow = dataflow.ppo_with_critic(True, vtrace=True, prox=True)
    world, roles = 2, ("actor", "critic", "ref")
    shared = role_layouts(PlacementConfig(), world, roles)
    assert exchanges(flow, shared, shared["actor"]) == {}  # the driver reads the actor's shares
    apart = PlacementConfig(actor=RolePlacement(ranks=[0]), critic=RolePlacement(ranks=[1]))
    layouts = role_layouts(apart, world, roles)
    assert layouts == {"actor": ((0,), 1), "critic": ((1,), 1), "ref": ((0,), 1)}  # ref: actor's
    # the advantages (every rank, the whole batch) read all three; the actor its own prox and ref
    got = exchanges(flow, layouts, None)
    assert set(got) == {"advantages"}
    assert sorted(got["advantages"]) == ["prox_logp", "ref_logp", "values"]
    # the ref beside the critic: the actor's KL term reads π_ref from there too, once
    kl_loss = dataflow.ppo_with_critic(False, kl_loss=True)
    apart = PlacementConfig(actor=RolePlacement(ranks=[0]), ref=RolePlacement(ranks=[1]))
    apart.critic = RolePlacement(ranks=[1])
    layouts = role_layouts(apart, world, roles)
    assert exchanges(kl_loss, layouts, None) == {
        "advantages": ("values",),
        "train_actor": ("ref_logp",),
    }
    # every rank, but the ref in one tensor-parallel group of 2: it splits the batch otherwise
    tp_ref = PlacementConfig(ref=RolePlacement(tensor_parallel=2))
    layouts = role_layouts(tp_ref, world, roles)
    assert exchanges(kl_loss, layouts, layouts["actor"]) == {"train_actor": ("ref_logp",)}


@pytest.mark.parametrize(
    ("placement", "key", "says"),
    [
        ({"actor": [1], "critic": [0]}, "placement.actor.ranks", "must include it, got [1]"),
        ({"actor": [0], "critic": [2]}, "placement.critic.ranks", "the learner has 2 rank(s)"),
        ({"actor": [0, 1], "critic": [1]}, "placement.critic.ranks", "shares ranks [1]"),
    ],
)
def test_a_placement_the_learner_cannot_run_is_one_line_naming_the_key(placement, key, says):
    p = PlacementConfig(**{role: RolePlacement(ranks=r) for role, r in placement.items()})
    with pytest.raises(RecipeError) as e:
        check_placement(p, 2)
    assert str(e.value).startswith(f"{key}: ") and says in str(e.value)
    assert "\n" not in str(e.value)


def test_the_cli_refuses_the_actor_off_rank_0_in_one_line(tiny_qwen3, tmp_path):
    """Under torchrun, through the learner's CLI, before any model loads: rank 0 runs the buffer
    client and the weight broadcaster, so the actor must be there."""
    placement = {"actor": {"ranks": [1]}, "critic": {"ranks": [0]}}
    recipe = ppo_recipe(tmp_path, tiny_qwen3, placement)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd += ["2", "-m", "asyncrl.learner.main", str(recipe)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("asyncrl learner: ")]
    assert len(ours) == 2, proc.stderr[-3000:]  # one line from each rank
    assert all("placement.actor.ranks: rank 0 runs the buffer client" in line for line in ours)


def test_only_the_roles_a_run_uses_are_placed():
    """GRPO or SFT with the actor on rank 0 of 2: no critic and no ref, so nothing to meet (the
    unused critic's default, every rank, would otherwise share rank 0 with the actor)."""
    p = PlacementConfig(actor=RolePlacement(ranks=[0]))
    check_placement(p, 2, roles=("actor",))
    with pytest.raises(RecipeError, match="placement.critic.ranks: shares ranks"):
        check_placement(p, 2, roles=("actor", "critic"))


@pytest.mark.slow
def test_the_cli_runs_and_resumes_with_a_rank_that_holds_no_model(tiny_qwen3, tmp_path):
    """`asyncrl learner` under torchrun, SFT with the actor on rank 0 of 2 (rank 1 holds nothing but
    joins every global collective): it checkpoints and exports each version, ends cleanly, and a
    second run resumes the first's last checkpoint."""
    from asyncrl import tasks

    train, _ = tasks.write_task("reverse", tmp_path / "data", train=64, eval=8)
    spec = {
        "run": {"name": "s", "output_dir": str(tmp_path / "runs"), "steps": 2},
        "model": {"path": str(tiny_qwen3), "max_seq_len": 64},
        "data": {"path": str(train)},
        "algorithm": {"loss": "sft"},
        "learner": {"batch_size": 8, "checkpoint_every": 1, "export_every": 1},
        "logging": {"wandb": False},
        "placement": {"actor": {"ranks": [0]}},
    }
    recipe = tmp_path / "sft.yaml"
    recipe.write_text(yaml.safe_dump(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd += ["2", "-m", "asyncrl.learner.main", str(recipe)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    run = tmp_path / "runs" / "s"
    assert (run / "checkpoints" / "step-2" / ".metadata").is_file()
    assert (run / "hf" / "v2" / "config.json").is_file()
    again = cmd + ["run.resume=true", "run.steps=3"]
    second = subprocess.run(again, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "asyncrl learner: resumed at version 2" in second.stderr
    assert "completed at version 3" in second.stderr
