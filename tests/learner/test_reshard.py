"""π_ref filled by resharding the actor's initial weights into π_ref's layout
(:mod:`asyncrl.learner.reshard`) instead of a second read of the HF folder: on 2 and 4 gloo ranks,
from tensor parallelism to none and back, the ref's full tensors and its log π are bitwise those of
a ref loaded from HF directly; a resumed run loads π_ref from HF."""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from asyncrl import recipe as recipe_mod
from asyncrl.learner.source import encode_batch
from tests.learner.step_on_batch import torchrun
from tests.learner.test_tensor_parallel import KL_LOSS, _batch

# Not `numerics`: every comparison here is bitwise, between one computation done with and without
# a reshard. Another CPU's kernels change both sides alike, so the kernel-path passes of
# `make test` (tests/numerics.py) would repeat these tests without testing anything new.

SCRIPT = Path(__file__).with_name("reshard_ranks.py")


def _spec(tmp_path: Path, model: Path, placement: dict) -> dict:
    return {
        "run": {"output_dir": str(tmp_path / "runs")},
        "model": {"path": str(model), "max_seq_len": 64},
        "algorithm": KL_LOSS,
        "learner": {"lr": 1e-3, "micro_batch_tokens": 40},
        "buffer": {"max_staleness": 2},
        "placement": placement,
        "logging": {"wandb": False},
    }


@pytest.mark.parametrize(
    ("fixture", "placement", "ranks"),
    [
        # the actor's TP 2 into a ref without TP (FSDP over both ranks); tied embeddings
        ("tiny_qwen3", {"actor": {"tensor_parallel": 2}}, 2),
        # the other way: FSDP over both ranks into a TP group of two; untied output projection
        ("tiny_llama", {"ref": {"tensor_parallel": 2}}, 2),
        # TP 2 × DP 2 into DP 4: the vocabulary's 99 rows in shards of 25, 25, 25, 24
        ("tiny_llama", {"actor": {"tensor_parallel": 2}}, 4),
    ],
    ids=["qwen3-tp2-to-tp1", "llama-tp1-to-tp2", "llama-tp2dp2-to-dp4"],
)
@pytest.mark.slow
def test_a_resharded_ref_is_bitwise_the_hf_loaded_one(fixture, placement, ranks, request, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(_spec(tmp_path, request.getfixturevalue(fixture), placement)))
    (tmp_path / "batch.bin").write_bytes(encode_batch(_batch()))
    cmd = [*torchrun(ranks), str(SCRIPT), str(recipe), str(tmp_path / "batch.bin"), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads((tmp_path / "reshard.json").read_text())
    assert rep["ref_source"] == "reshard"
    assert rep["differ"] == rep["differ_actor"] == rep["differ_after_second"] == []
    assert rep["bytes"] == rep["model_bytes"] > 0
    assert rep["logprobs_equal_ranks"] == ranks
    assert rep["logprobs_tokens"] > 0


def test_a_resumed_run_loads_the_ref_from_hf(tiny_qwen3, tmp_path, caplog):
    """One rank: a fresh start reshards (the actor and π_ref in one layout), a resume from a
    checkpoint reads π_ref from HF (the actor then holds the checkpoint's weights)."""
    import torch

    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.trainer import Trainer

    torch.set_num_threads(1)
    spec = _spec(tmp_path, tiny_qwen3, {})
    caplog.set_level(logging.INFO, logger="asyncrl.learner")
    tr = Trainer(TrainerConfig.from_recipe(recipe_mod.from_dict(spec)), run_dir=tmp_path / "run")
    try:
        assert not tr.resumed and tr.ref_source == "reshard"
        fresh = [r.getMessage() for r in caplog.records if r.getMessage().startswith("π_ref:")]
        assert fresh == [
            "π_ref: resharded from the actor's initial weights (tensor_parallel 1 -> 1, 2.0 MiB gathered)"
        ]
        assert tr.save_checkpoint(force=True) is not False
        tr.wait_for_checkpoint()
    finally:
        tr.close()
    caplog.clear()
    spec["run"]["resume"] = True
    tr = Trainer(TrainerConfig.from_recipe(recipe_mod.from_dict(spec)), run_dir=tmp_path / "run")
    try:
        assert tr.resumed and tr.ref_source == "hf"
    finally:
        tr.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("π_ref:")]
    assert lines == [f"π_ref: loaded from {tr.model_dir} (the actor holds trained weights)"]


def test_plain_modules_copy_in_place_and_other_models_are_refused():
    """Without DTensors (one process) the copy writes into the destination's own tensors; a model
    with other shapes, or no source on this rank, is refused in one line."""
    import torch
    from torch import nn

    from asyncrl.learner.reshard import ReshardError, reshard

    src, dst = nn.Linear(3, 4), nn.Linear(3, 4)
    weight = dst.weight
    assert reshard(src, dst) == 4 * (12 + 4)
    assert dst.weight is weight and torch.equal(dst.weight, src.weight)
    assert torch.equal(dst.bias, src.bias)
    with pytest.raises(ReshardError, match=r"the models differ .*weight"):
        reshard(src, nn.Linear(3, 5))
    with pytest.raises(ReshardError, match="holds no source model"):
        reshard(None, dst)  # type: ignore[arg-type]
