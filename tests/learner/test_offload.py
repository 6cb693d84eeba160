"""Parameter reallocation (asyncrl/learner/offload.py) on the learner's real FSDP2 models, one rank on
CPU: offload → reload gives back every parameter, gradient and AdamW state bitwise; the bytes freed
are the role's 16·P (+ AdamW's step counters); FSDP2's all-gathered buffers go too; and a step with
the critic and the reference offloaded between their calls trains exactly as one without.

On CPU the learner itself does not offload (the device is host memory); the step test installs the
real offloaders on the trainer to run the same hook a GPU run takes."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from asyncrl.learner.offload import (
    HOST_ALIGN,
    Offloader,
    Reallocation,
    host_bytes,
    host_layout,
    pow2_ceil,
    role_tensors,
)
from asyncrl.learner.passes import token_logprobs
from asyncrl.memory import ModelDims
from tests.learner.test_model import make_trainer
from tests.learner.test_step import rl_batch

# Not `numerics`: every comparison here is bitwise, between one computation done with and without
# offload and reload. Another CPU's kernels change both sides alike, so the kernel-path passes of
# `make test` (tests/numerics.py) would repeat these tests without testing anything new.

RL = {"learner": {"lr": 1e-3, "grad_clip": 1.0}, "buffer": {"max_staleness": 8}}
PPO = {"advantage": "gae", "loss": "ppo", "kl_coef": 0.05}


def snapshot(model: torch.nn.Module, optimizers: list) -> list[torch.Tensor]:
    return [t.clone() for t in role_tensors(model, optimizers)]


def fsdp_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(sharded, unsharded): bytes of FSDP2's own references to the padded shards and to its
    all-gather outputs (the unsharded parameters) that are allocated."""
    sharded: dict[int, int] = {}
    unsharded = 0
    for m in model.modules():
        if isinstance(m, FSDPModule):
            for group in m._get_fsdp_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    s = fp._sharded_param_data.untyped_storage()
                    sharded[id(fp)] = s.nbytes()
                    unsharded += sum(t.untyped_storage().nbytes() for t in fp.all_gather_outputs)
    return sum(sharded.values()), unsharded


def test_offload_frees_the_roles_bytes_and_reload_is_bitwise(tiny_qwen3, tmp_path):
    tr = make_trainer(tiny_qwen3, tmp_path, algorithm=PPO, **RL)
    tr.step(rl_batch(tr.models.spec.model.vocab_size))  # gradients and AdamW state exist
    opts = list(tr.models.optimizers)
    before = snapshot(tr.models.actor, opts)
    params = list(tr.models.actor.parameters())
    p = sum(x.numel() for x in params)
    assert (
        p == ModelDims.from_hf_config(json.loads((tiny_qwen3 / "config.json").read_text())).params
    )
    off = Offloader(model=tr.models.actor, optimizers=opts)

    freed = off.offload()
    # float32 parameters, gradients and both AdamW moments (memory.py's 16·P on one rank), and
    # AdamW's float32 step counter per parameter
    assert freed == 16 * p + 4 * len(params) == 8_079_440
    assert all(t.untyped_storage().nbytes() == 0 for t in role_tensors(tr.models.actor, opts))
    assert off.offload() == 0  # already on the host

    assert off.reload() == freed
    after = list(role_tensors(tr.models.actor, opts))
    assert len(after) == len(before) == 5 * len(params)  # param, grad, exp_avg, exp_avg_sq, step
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert off.reload() == 0


def storage_bytes(s: torch.UntypedStorage) -> bytes:
    """A storage's bytes through a uint8 view (``bytes(storage)`` reads them one Python call a
    byte: a minute for this model's)."""
    return torch.empty(0, dtype=torch.uint8).set_(s.cpu()).clone().numpy().tobytes()


def test_the_role_offloads_into_one_host_buffer_of_its_summed_sizes(tiny_qwen3, tmp_path):
    """One host buffer a role, each storage's bytes at its aligned offset in it, no power-of-two
    rounding per storage (torch's caching host allocator's, for a pinned tensor each); reused by
    the next offload; the round trip bitwise."""
    tr = make_trainer(tiny_qwen3, tmp_path, algorithm=PPO, **RL)
    tr.step(rl_batch(tr.models.spec.model.vocab_size))
    off = Offloader(model=tr.models.actor, optimizers=list(tr.models.optimizers))
    storages = off.storages()
    sizes = [s.nbytes() for s in storages]
    before = [storage_bytes(s) for s in storages]
    offsets, total = host_layout(sizes)
    assert all(o % HOST_ALIGN == 0 for o in offsets)
    assert sum(sizes) <= total < sum(sizes) + HOST_ALIGN * len(sizes)

    assert off.offload() == sum(sizes)
    assert off.host_nbytes == total < host_bytes(sizes)["per_storage_pinned"]
    host = off._host
    for o, n, want in zip(offsets, sizes, before, strict=True):
        assert bytes(host[o : o + n].numpy()) == want
    off.reload()
    assert [storage_bytes(s) for s in storages] == before
    off.offload()
    assert off._host is host  # kept while the sizes are the same
    off.reload()
    assert [storage_bytes(s) for s in storages] == before


def test_host_bytes_by_layout():
    """A storage of 5,000 bytes and one of 3: the caching host allocator's pinned blocks are 8,192
    and 4 bytes; one buffer of both, the second at offset 5,120, is 5,123 (rounded once: 8,192)."""
    assert [pow2_ceil(n) for n in (0, 1, 3, 4, 5000, 2**30 + 1)] == [0, 1, 4, 4, 8192, 2**31]
    assert host_layout([5000, 3]) == ([0, 5120], 5123)
    assert host_bytes([5000, 3]) == {
        "storage_bytes": 5003,
        "per_storage_pinned": 8196,
        "one_pinned": 8192,
        "one_registered": 5123,
    }


def test_a_forward_only_role_also_frees_fsdps_gathered_parameters(tiny_qwen3, tmp_path):
    """A forward without a backward leaves TorchTitan's root unit (final norm and output
    projection, not resharded after forward) all-gathered: the offload reshards it first."""
    tr = make_trainer(tiny_qwen3, tmp_path, algorithm=PPO, **RL)
    seqs = tr.sequences(rl_batch(tr.models.spec.model.vocab_size))
    mbs = tr.micro_batches(seqs)
    ref_before = tr.logprobs(mbs)
    p = 4 * sum(x.numel() for x in tr.models.ref.parameters())
    assert fsdp_bytes(tr.models.ref) == (p, 0)  # the actor's forward did not touch the ref
    token_logprobs(tr.models, mbs[0], tr.models.ref)
    assert fsdp_bytes(tr.models.ref)[1] > 0
    off = Offloader(model=tr.models.ref)
    assert off.offload() == p  # frozen: its parameters only
    assert fsdp_bytes(tr.models.ref) == (0, 0)
    off.reload()
    assert fsdp_bytes(tr.models.ref) == (p, 0)
    assert all(torch.equal(a, b) for a, b in zip(tr.logprobs(mbs), ref_before, strict=True))


def test_a_step_with_critic_and_ref_offloaded_trains_exactly_as_without(
    tiny_qwen3, tmp_path, caplog
):
    """PPO with a critic and a KL term: the ref offloaded after its forward, the critic after its
    update (reloaded before its values), over two steps: actor, critic and their AdamW states equal
    a run that keeps them resident, bitwise."""
    placed = {"critic": {"offload": True}, "ref": {"offload": True}}
    runs = []
    for offload in (False, True):
        with caplog.at_level(logging.INFO, logger="asyncrl.learner"):
            kw = {"placement": placed} if offload else {}
            tr = make_trainer(tiny_qwen3, tmp_path / str(offload), algorithm=PPO, **RL, **kw)
        if offload:  # on CPU the learner says so and leaves them; install the real offloaders
            said = [r.getMessage() for r in caplog.records if "offload" in r.getMessage()]
            assert said == [
                f"placement.{r}.offload: on CPU the device is host memory: nothing is freed"
                for r in ("critic", "ref")
            ]
            assert tr.realloc.offloaders == {}
            c = tr.models.critic
            tr.realloc = Reallocation(
                offloaders={
                    "critic": Offloader(model=c.model, optimizers=list(c.optimizers)),
                    "ref": Offloader(model=tr.models.ref),
                }
            )
        for seed in (0, 1):
            tr.step(rl_batch(tr.models.spec.model.vocab_size, seed=seed))
            if offload:  # between steps both roles are on the host
                assert tr.realloc.offloaders["critic"].offloaded
                assert tr.realloc.offloaders["ref"].offloaded
                assert tr.realloc.freed["ref"] == 4 * sum(
                    x.numel() for x in tr.models.ref.parameters()
                )
        tr.realloc.reload_all()
        runs.append(
            snapshot(tr.models.actor, list(tr.models.optimizers))
            + snapshot(tr.models.critic.model, list(tr.models.critic.optimizers))
        )
    plain, offloaded = runs
    assert len(plain) == len(offloaded) > 0
    assert all(torch.equal(a, b) for a, b in zip(plain, offloaded, strict=True))


@pytest.mark.slow
def test_two_ranks_offload_their_own_shards_and_train_on(tiny_qwen3, tmp_path):
    """2 ranks under torchrun (gloo): each rank frees its own shards, gradients and AdamW state,
    gets them back bitwise, and the next step equals a run's that did not offload."""
    out = tmp_path / "found.json"
    script = Path(__file__).with_name("offload_two_ranks.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    p = subprocess.run(
        [*cmd, str(script), str(tiny_qwen3), str(out)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    ranks = json.loads(out.read_text())
    p_all = ModelDims.from_hf_config(json.loads((tiny_qwen3 / "config.json").read_text())).params
    assert sum(r["local_params"] for r in ranks) == p_all
    for r in ranks:
        assert r["emptied"] and r["bitwise"] and r["same_step"]
        # parameters and gradients as FSDP2 keeps them, padded to ceil(rows / ranks) rows (the
        # shard and the reduce-scatter output), AdamW's moments unpadded, one step counter each
        assert r["freed"] == 8 * r["padded_params"] + 8 * r["local_params"] + 4 * r["tensors"]
    # measured: rank 1's half of the 99-row embedding is padded by one row of 128 in both
    assert [r["freed"] for r in ranks] == [4_040_784, 4_039_760]
