"""Two ranks under torchrun (gloo, FSDP2) through the real CLI: one step equals one rank on the same
global batch; a checkpoint, a hard crash and a resume give bitwise the losses and weights of an
uninterrupted run. (The crash is injected from outside the package, by a sitecustomize the test puts
on PYTHONPATH: both ranks ``os._exit`` when they are about to train the version after the crash
version, its checkpoint written and its metrics logged, which a real kill at that moment would
also produce.)"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from asyncrl import metric_names, tasks
from asyncrl import recipe as recipe_mod
from asyncrl.metrics import read_metrics
from tests.learner.step_on_batch import random_sample, run_ranks
from tests.learner.step_on_batch import torchrun as torchrun_cmd
from tests.module_hook import sitecustomize
from tests.numerics import assert_adam_steps_agree, assert_close_rel, hf_grads

STEPS = 3


def torchrun(recipe: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    cmd = [*torchrun_cmd(), "-m", "asyncrl.learner.main", str(recipe), *overrides]
    e = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(
        cmd, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


# The fault (a hard exit between two steps, after the checkpoint) is one a real process can have.
CRASH_AFTER = """
version = VERSION
step = module.Trainer.step

def crashing_step(self, batch):
    if self.version == version:
        self.wait_for_checkpoint()
        os._exit(3)
    return step(self, batch)

module.Trainer.step = crashing_step
"""


def crash_env(folder: Path, version: int) -> dict[str, str]:
    """The environment of a learner that exits hard after version ``version`` (CRASH_AFTER)."""
    folder.mkdir(parents=True, exist_ok=True)
    patch = CRASH_AFTER.replace("VERSION", str(version))
    (folder / "sitecustomize.py").write_text(sitecustomize("asyncrl.learner.trainer", patch))
    return {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
    }


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


@pytest.fixture(scope="module")
def runs(tiny_qwen3, tmp_path_factory):
    root = tmp_path_factory.mktemp("learner_dist")
    train, _ = tasks.write_task("reverse", root / "data", train=256, eval=8)
    spec = {
        "run": {"name": "u", "output_dir": str(root / "runs"), "steps": STEPS},
        "model": {"path": str(tiny_qwen3), "max_seq_len": 64},
        "data": {"path": str(train)},
        "algorithm": {"loss": "sft"},
        "learner": {
            "lr": 1e-3,
            "batch_size": 24,
            "micro_batch_tokens": 60,  # several micro-batches per rank, uneven counts
            "logits_chunk_mb": 0.01,  # the output projection in 6-token chunks
            "checkpoint_every": 1,
            "export_every": 1,
            "keep_checkpoints": 0,
        },
        "logging": {"wandb": False},
    }
    recipe = root / "sft.yaml"
    recipe.write_text(yaml.safe_dump(spec))
    # the uninterrupted run and the one that crashes after version 1 are independent: run together
    u = torchrun(recipe)
    k = torchrun(recipe, "run.name=k", env=crash_env(root / "crash", 1))
    (u_rc, u_err), (k_rc, _) = finish(u), finish(k)
    assert u_rc == 0, u_err[-3000:]
    r_rc, r_err = finish(torchrun(recipe, "run.name=k", "run.resume=true"))
    assert r_rc == 0, r_err[-3000:]
    return {"root": root, "recipe": recipe, "crash_rc": k_rc, "runs": root / "runs"}


def losses(run_dir: Path) -> dict[int, tuple[float, float]]:
    return {m["step"]: (m["loss"], m["grad_norm"]) for m in read_metrics(run_dir)}


@pytest.mark.numerics
@pytest.mark.slow
def test_two_ranks_match_one_rank_on_the_same_global_batch(runs, tmp_path):
    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.dataset_sources import SFTSource
    from asyncrl.learner.trainer import Trainer

    recipe = recipe_mod.load(runs["recipe"], ["learner.micro_batch_tokens=4096"])
    tr = Trainer(TrainerConfig.from_recipe(recipe), run_dir=tmp_path, checkpointing=False)
    res = tr.step(SFTSource.from_recipe(recipe).next_batch())
    assert res.metrics["learner/micro_batches"] == 1
    loss2, gn2 = losses(runs["runs"] / "u")[1]
    assert_close_rel(res.loss, loss2)
    assert_close_rel(res.metrics["grad_norm"], gn2)
    exported = load_file(str(runs["runs"] / "u" / "hf" / "v1" / "model-00001-of-00001.safetensors"))
    mine = tr.hf_state_dict()
    assert set(mine) == set(exported)
    # One Adam step each: entries whose gradient is within rounding of 0 may move ±lr apart.
    grads = hf_grads(tr)
    assert_adam_steps_agree(mine, exported, grads, lr=res.metrics["lr"])


def test_crash_and_resume_is_bitwise_identical(runs):
    assert runs["crash_rc"] != 0
    ckpts = runs["runs"] / "k" / "checkpoints"
    assert (ckpts / "step-1" / ".metadata").is_file()
    u, k = losses(runs["runs"] / "u"), losses(runs["runs"] / "k")
    assert sorted(k) == [1, 2, 3]  # step 1 from the crashed run, 2 and 3 from the resumed one
    for step in (2, 3):
        assert k[step] == u[step]  # bitwise: same floats
    a = load_file(str(runs["runs"] / "u" / "hf" / f"v{STEPS}" / "model-00001-of-00001.safetensors"))
    b = load_file(str(runs["runs"] / "k" / "hf" / f"v{STEPS}" / "model-00001-of-00001.safetensors"))
    assert all(torch.equal(a[n], b[n]) for n in a)
    state = json.loads((runs["runs"] / "k" / "metrics.jsonl").read_text().splitlines()[-1])
    assert state["step"] == STEPS


KL_LOSS = {"loss": "ppo", "kl_coef": 0.1}
CRITIC_KL_REWARD = {"loss": "ppo", "advantage": "gae", "kl_reward_coef": 0.1}


@pytest.mark.numerics
@pytest.mark.parametrize(
    ("fixture", "chunk_mb", "alg"),
    [
        ("tiny_qwen3", 256.0, KL_LOSS),  # tied, one chunk
        ("tiny_llama", 0.01, KL_LOSS),  # untied, 6-token chunks
        ("tiny_qwen3", 256.0, CRITIC_KL_REWARD),  # a critic and a KL reward
    ],
)
@pytest.mark.slow
def test_a_rank_without_trained_tokens_steps_with_the_others(
    fixture, chunk_mb, alg, request, tmp_path
):
    """Two ranks, with the reference KL on, on a batch whose second rank receives only a sample with
    no trained token: every collective (micro-batch count, the reference model's FSDP forward, the
    output projection's chunks, the statistics) still pairs up, and the step equals one rank's on
    the same batch. (Before, rank 1 skipped the reference forward and reduced a shorter statistics
    tensor: a crash.) Tied and untied embeddings put the projection in different FSDP groups. With
    a critic: its values pass, the advantages' whitening and its update pair up as well."""

    from asyncrl import wire
    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.packing import make_sequence, split_over_ranks
    from asyncrl.learner.source import Batch, encode_batch
    from asyncrl.learner.trainer import Trainer

    samples = [random_sample(0, 30, True), random_sample(1, 6, False)]
    batch = Batch(groups=[wire.Group(id="g", samples=samples)], version=0, stats={})
    shares = split_over_ranks(
        [
            make_sequence(i, s.prompt_ids, s.completion_ids, loss_mask=s.loss_mask)
            for i, s in enumerate(samples)
        ],
        2,
    )
    assert [sum(float(q.mask.sum()) for q in sh) for sh in shares][1] == 0  # rank 1: nothing

    spec = {
        "run": {"output_dir": str(tmp_path / "runs")},
        "model": {"path": str(request.getfixturevalue(fixture)), "max_seq_len": 64},
        "algorithm": alg,
        "learner": {"lr": 1e-3, "micro_batch_tokens": 32, "logits_chunk_mb": chunk_mb},
        "buffer": {"max_staleness": 2},
        "logging": {"wandb": False},
    }
    recipe_file = tmp_path / "rl.yaml"
    recipe_file.write_text(yaml.safe_dump(spec))
    (tmp_path / "batch.bin").write_bytes(encode_batch(batch))
    proc = run_ranks(recipe_file, tmp_path / "batch.bin", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((tmp_path / "metrics.json").read_text())
    # a weight broadcast's gather: rank 0 keeps every tensor, in the wire dtype; rank 1 nothing
    kept = [json.loads((tmp_path / f"kept-rank{r}.json").read_text()) for r in (0, 1)]
    n = len(load_file(str(tmp_path / "weights.safetensors")))
    assert kept == [{"tensors": n, "dtypes": ["torch.bfloat16"]}, {"tensors": 0, "dtypes": []}]

    tr = Trainer(
        TrainerConfig.from_recipe(recipe_mod.load(recipe_file)),
        run_dir=tmp_path / "one",
        checkpointing=False,
    )
    one = tr.step(batch)
    assert one.metrics["loss/tokens"] == two["loss/tokens"] == 30
    assert_close_rel(one.loss, two["loss"], scale=1.0)  # with a critic: whitened advantages
    assert_close_rel(one.metrics["grad_norm"], two["grad_norm"])
    if alg is KL_LOSS:
        assert one.metrics["loss/kl_ref"] == two["loss/kl_ref"] == 0.0  # π = π_ref at step 1
    else:
        for k in (metric_names.VALUE_LOSS, "critic/grad_norm", metric_names.EXPLAINED_VARIANCE):
            assert_close_rel(one.metrics[k], two[k])
    assert_adam_steps_agree(
        tr.hf_state_dict(),
        load_file(str(tmp_path / "weights.safetensors")),
        hf_grads(tr),
        lr=one.metrics["lr"],
    )
