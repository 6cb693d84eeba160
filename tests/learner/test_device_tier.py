"""The learner's step on a device that is not the host (:mod:`tests.device_tier`): forward,
loss, backward, clip and AdamW with the model and every batch tensor on the pretend device, on one
rank and on two gloo ranks (FSDP2 or tensor-parallel), LoRA, a mixture of experts replaying
routes, a critic and a reward model too. It fails where CUDA would (a host tensor in device compute),
and counts the host's waits for the device per micro-batch.

Why a ``__torch_function__`` mode of our own over the real computation, and not the ``meta`` device
or ``FakeTensorMode``: :func:`test_the_stand_ins_miss_what_the_tier_catches` shows what those let
through with this torch, and neither has values to finish a step or to pass through gloo.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl.learner.losses.aggregation import count_tokens_and_seqs
from tests.device_tier import DeviceMixError, PretendDevice, pretend_device
from tests.learner.test_model import make_trainer
from tests.learner.test_route_checks import routed
from tests.learner.test_step import rl_batch

RL = {"learner": {"lr": 1e-3, "grad_clip": 1.0}, "buffer": {"max_staleness": 8}}


def test_the_stand_ins_miss_what_the_tier_catches():
    """CUDA refuses device indices into a host tensor (crash 1 of issue #54). ``meta`` lets both
    the read and the write through, FakeTensorMode the read; the tier refuses both, and lets
    through what CUDA allows (a 0-dim host tensor as a scalar, a copy to the device)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def index(ids, w):
        host = torch.zeros(4, dtype=torch.float64)
        return host[ids]

    def index_put(ids, w):
        host = torch.zeros(4, dtype=torch.float64)
        host[ids] = w

    missed = []
    meta = (torch.zeros(3, dtype=torch.long, device="meta"), torch.ones(3, device="meta"))
    with FakeTensorMode(allow_non_fake_inputs=False):
        fake = (torch.zeros(3, dtype=torch.long, device="cuda"), torch.ones(3, device="cuda"))
        for f in (index, index_put):
            try:
                f(*fake)
                missed.append(("fake", f.__name__))
            except Exception:
                pass
    for f in (index, index_put):
        try:
            f(*meta)
            missed.append(("meta", f.__name__))
        except Exception:
            pass
    assert missed == [("fake", "index"), ("meta", "index"), ("meta", "index_put")]

    with PretendDevice() as mode:
        ids = torch.zeros(3, dtype=torch.long).to("cuda")
        w = torch.ones(3, dtype=torch.float64).to(ids.device)
        for f in (index, index_put):
            with pytest.raises(DeviceMixError):
                f(ids, w)
        assert ids.device == torch.device("cuda", 0)
        scalar = torch.tensor(2.0)  # a 0-dim host tensor is a scalar to CUDA's kernels
        assert (w * scalar).device.type == "cuda"
        on_device = torch.zeros(3, dtype=torch.float64, device=ids.device)
        on_device.copy_(torch.ones(3, dtype=torch.float64))  # host → device: no wait
        assert mode.reads == []
        assert float(on_device.sum()) == 3.0 and len(mode.reads) == 1


def test_count_tokens_and_seqs_stays_on_the_device():
    """Crash 1: the per-sequence weights were summed in a host tensor indexed by device ids."""
    with PretendDevice() as mode:
        mask = torch.tensor([1.0, 1.0, 0.0, 1.0]).to("cuda")
        ids = torch.tensor([0, 0, 1, 2]).to("cuda")
        w = torch.tensor([0.5, 0.5, 0.25, 1.0], dtype=torch.float64).to("cuda")
        counts = count_tokens_and_seqs(mask, ids, w)
        assert counts.device.type == "cuda" and mode.reads == []
        assert counts.tolist() == [3.0, 1.5]


def _step(tr, *, seed: int = 0):
    return tr.step(rl_batch(tr.models.spec.model.vocab_size, groups=3, seed=seed))


def where(mode: PretendDevice) -> list[str]:
    return [f"{r.name} at {r.where}" for r in mode.reads]


def check_reads(mode: PretendDevice, micro_batches: int, passes: int = 0) -> None:
    """One read for the step's totals (at its end), and one per micro-batch of each forward-only
    pass (π_prox, π_ref: their per-token results go onto the sequences, on the host)."""
    stored = [r for r in mode.reads if r.where.endswith(" per_token")]
    assert len(stored) == passes * micro_batches, where(mode)
    rest = [r for r in mode.reads if r not in stored]
    assert [r.where.split(":")[0] for r in rest] == ["learner/step.py"], where(mode)
    assert rest[0].where.endswith(" sum_over_ranks") and mode.reads[-1] is rest[0]


@pytest.mark.parametrize(
    ("alg", "passes"),
    [
        ({"loss": "ppo"}, 0),
        ({"loss": "decoupled_ppo", "entropy_coef": 0.01}, 0),
        ({"loss": "gspo", "aggregation": "seq_mean_token_mean", "seq_mask_high": 5.0}, 0),
        ({"loss": "tis", "is_level": "sequence", "kl_coef": 0.1}, 1),
        ({"loss": "sft"}, 0),
        ({"advantage": "gae", "loss": "ppo"}, 1),  # the critic's values, then its update
    ],
    ids=lambda a: a.get("advantage", a["loss"]) if isinstance(a, dict) else str(a),
)
def test_a_step_on_the_device_reads_the_host_once(tiny_qwen3, tmp_path, alg, passes):
    """One step of several micro-batches, every tensor of the step on the device: no host tensor
    in device compute, and one host read for all the updates' totals, whatever the loss,
    aggregation and regularisers (a KL penalty's π_ref pass: one more per micro-batch; so does a
    critic's values pass, and its update reads nothing)."""
    tr = make_trainer(
        tiny_qwen3,
        tmp_path,
        algorithm=alg,
        learner={**RL["learner"], "micro_batch_tokens": 48},
        buffer=RL["buffer"],
    )
    with pretend_device(tr.models) as mode:
        res = _step(tr)
    mbs = int(res.metrics["learner/micro_batches"])
    assert mbs >= 3
    assert res.metrics["loss/tokens"] > 0 and torch.isfinite(torch.tensor(res.loss))
    check_reads(mode, mbs, passes)


def test_lora_step_on_the_device(tiny_qwen3, tmp_path):
    lora = {"rank": 4, "alpha": 8.0}
    tr = make_trainer(
        tiny_qwen3, tmp_path, learner={**RL["learner"], "lora": lora}, buffer=RL["buffer"]
    )
    with pretend_device(tr.models) as mode:
        res = _step(tr)
    assert res.metrics["loss/tokens"] > 0
    check_reads(mode, int(res.metrics["learner/micro_batches"]))


def test_several_updates_on_the_device(tiny_qwen3, tmp_path):
    """Two mini-batches: π_prox is recomputed first, a forward-only pass whose log π per
    micro-batch comes to the host once (to be stored on the sequences); the two updates' totals
    are read once, at the step's end."""
    tr = make_trainer(
        tiny_qwen3,
        tmp_path,
        algorithm={"loss": "decoupled_ppo"},
        learner={**RL["learner"], "minibatches": 2, "micro_batch_tokens": 48},
        buffer=RL["buffer"],
    )
    with pretend_device(tr.models) as mode:
        res = _step(tr)
    assert res.metrics["learner/updates"] == 2 and "grad_norm/max" in res.metrics
    stored = [r for r in mode.reads if r.where.endswith(" per_token")]
    # the prox pass packs the whole share; the updates pack each mini-batch apart
    assert 1 <= len(stored) <= res.metrics["learner/micro_batches"], where(mode)
    assert len(mode.reads) == len(stored) + 1, where(mode)


def test_moe_step_with_routing_replay_on_the_device(tiny_qwen3_moe, tmp_path):
    """A mixture of experts in bfloat16, as on a GPU: TorchTitan's grouped GEMM (``Experts``
    keeps it for bfloat16 on CUDA), every sample's recorded experts replayed, the load-balancing
    loss on. Its routes go to the device with the batch, its agreement count stays there until
    the step's one read."""
    tr = make_trainer(
        tiny_qwen3_moe,
        tmp_path,
        model={"dtype": "bfloat16"},
        algorithm={"routing_replay": True, "moe_aux_loss_coef": 0.01},
        learner={**RL["learner"], "micro_batch_tokens": 48},
        buffer=RL["buffer"],
    )
    batch = routed(rl_batch(tr.models.spec.model.vocab_size, groups=3), np.random.default_rng(0))
    with pretend_device(tr.models) as mode:
        res = tr.step(batch)
    assert res.metrics["loss/moe_aux"] > 0 and 0 <= res.metrics["learner/routing_agreement"] < 1
    check_reads(mode, int(res.metrics["learner/micro_batches"]))


def test_reward_model_step_on_the_device(tiny_qwen3, tmp_path):
    """A reward model's step (Bradley-Terry over preference pairs, several micro-batches): its
    sums stay on the device, read once with the gradient norm at the step's end; the held-out
    accuracy after it (its last step) reads once too."""
    from asyncrl import recipe as recipe_mod
    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.dataset_sources import PreferenceSource
    from asyncrl.learner.trainer import Trainer
    from tests.learner.test_reward_model import rm_recipe

    recipe = recipe_mod.from_dict(rm_recipe(tmp_path, tiny_qwen3, 1, micro_batch_tokens=100))
    tr = Trainer(TrainerConfig.from_recipe(recipe), checkpointing=False)
    batch = PreferenceSource.from_recipe(recipe).next_batch()
    try:
        with pretend_device(tr.models) as mode:
            res = tr.step(batch)
    finally:
        tr.close()
    assert res.metrics["learner/micro_batches"] > 1 and res.metrics["grad_norm"] > 0
    assert 0 <= res.metrics["rm/eval_accuracy"] <= 1
    assert [r.where.split(" ")[1] for r in mode.reads] == ["step", "held_out_accuracy"], where(mode)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp", "tp", "lora", "moe"])
def test_two_ranks_step_on_the_device(request, tmp_path, layout):
    """Two gloo ranks under torchrun, FSDP2 sharding the model (its LoRA adapters; a bfloat16
    mixture of experts replaying routes) or one tensor-parallel group of the two (DTensor's
    redistributions in the forward and the vocabulary-parallel log-probabilities), each on the
    pretend device: the step runs, and reads the host once."""
    model = request.getfixturevalue("tiny_qwen3_moe" if layout == "moe" else "tiny_qwen3")
    script = Path(__file__).with_name("device_tier_ranks.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    out = tmp_path / "out"
    p = subprocess.run(
        [*cmd, str(script), str(model), str(out), layout],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    found = json.loads((out / "found.json").read_text())
    assert len(found) == 2
    for rank in found:
        assert rank["micro_batches"] >= 2 and rank["reads"] == 1, rank
        assert rank["tp"] == (2 if layout == "tp" else 1)
        assert (rank["routing_agreement"] is not None) == (layout == "moe")


def test_entropy_is_computed_only_when_needed(tiny_qwen3, tmp_path, monkeypatch):
    """The forward-only passes (log π, π_prox, π_ref) compute no entropy, nor does the backward
    of a loss without an entropy term; the update's forward does, for its logged metric."""
    import asyncrl.learner.logprobs as lp

    tr = make_trainer(tiny_qwen3, tmp_path, algorithm={"loss": "ppo", "kl_coef": 0.1}, **RL)
    calls: list[bool] = []
    real = lp._token_logprobs

    def spy(logits, labels, temperature, *, entropy=True):
        calls.append(entropy)
        return real(logits, labels, temperature, entropy=entropy)

    monkeypatch.setattr(lp, "_token_logprobs", spy)
    batch = rl_batch(tr.models.spec.model.vocab_size)
    tr.logprobs(tr.micro_batches(tr.sequences(batch)))
    assert calls and not any(calls)
    calls.clear()
    res = tr.step(batch)  # π_ref's pass, then the update's forward and backward
    assert "loss/entropy" in res.metrics and "loss/kl_ref" in res.metrics
    mbs = int(res.metrics["learner/micro_batches"])
    assert calls.count(True) == mbs  # the update's forward: the metric
    assert calls.count(False) == 2 * mbs  # π_ref's forward and the update's backward


def test_adamw_is_fused_on_cuda_and_the_for_loop_on_cpu(tiny_qwen3, tmp_path):
    """On CUDA one fused kernel steps all the parameters; on CPU the for-loop stays, whose
    numbers tools/bench/learner_bitwise.py keeps."""
    tr = make_trainer(tiny_qwen3, tmp_path, **RL)
    (cpu,) = list(tr.models.optimizers)
    assert all(not g["fused"] and not g["foreach"] for g in cpu.param_groups)
    on_cuda = dataclasses.replace(tr.build, device=torch.device("cuda", 0))
    (cuda,) = list(on_cuda.optimizer(tr.models.actor, 1e-3)[0])
    assert all(g["fused"] and not g["foreach"] for g in cuda.param_groups)
