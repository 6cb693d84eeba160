"""Where the built-in engine runs and in which dtype (``generator.device``, ``--device``,
``--dtype``): on CPU float32 whatever the recipe's ``model.dtype`` (the engine's CPU numerics), on
CUDA the recipe's dtype. CUDA itself is not here: the choice takes whether torch sees a GPU as an
argument, and the half-precision forward (what runs on CUDA) runs on CPU as well."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl import gpu, recipe
from asyncrl.engine.api import placement
from asyncrl.engine.batched_model import BatchedLM
from asyncrl.rollout.main import engine_env


def test_on_cpu_the_engine_stays_float32_whatever_the_dtype():
    """The default (auto) on a machine without a GPU, and cpu anywhere, keep float32: the CPU
    engine's behaviour before it could run on CUDA."""
    for dtype in ("float32", "bfloat16", "float16"):
        assert placement("auto", dtype, cuda=False) == ("cpu", torch.float32)
        assert placement("cpu", dtype, cuda=True) == ("cpu", torch.float32)


def test_on_cuda_the_engine_runs_in_the_recipe_dtype():
    assert placement("auto", "bfloat16", cuda=True) == ("cuda", torch.bfloat16)
    assert placement("cuda", "float16", cuda=True) == ("cuda", torch.float16)
    assert placement("cuda", "float32", cuda=True) == ("cuda", torch.float32)
    with pytest.raises(ValueError, match="no CUDA device"):
        placement("cuda", "bfloat16", cuda=False)
    with pytest.raises(ValueError, match="dtype 'int8'"):
        placement("auto", "int8", cuda=True)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_forward_runs_in_half_precision(tiny_qwen3, dtype):
    """What the engine runs on CUDA (model.dtype bfloat16), here on CPU: the slot-cache forward of a
    half-precision model, prefill then batched decode of mixed lengths, gives the logits of
    transformers' own forward in that dtype, with the KV cache in that dtype."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=dtype).eval()
    lm = BatchedLM(model)
    cache = lm.new_cache()
    assert lm.dtype == dtype and cache.k[0].dtype == dtype and cache.k[0].device == lm.device
    seqs = [[5, 6, 7, 8, 9], [10, 11, 12]]
    logits, _ = lm.prefill(cache, 0, [list(s) for s in seqs])
    for _ in range(4):
        for s, row in zip(seqs, logits, strict=True):
            s.append(int(row.argmax()))
        logits = lm.decode(cache, [s[-1] for s in seqs], [len(s) - 1 for s in seqs])
    assert logits.dtype == dtype
    for s, row in zip(seqs, logits, strict=True):
        ref = model(torch.tensor([s])).logits[0, -1]
        # one rounding of the dtype apart at most (fused projections, another reduction order)
        torch.testing.assert_close(row.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ("tiny_qwen3", "device cuda: torch sees no CUDA device here; use cpu or auto"),
        ("tiny_reward_model", "device cuda: a sequence-classification model is served on CPU only"),
    ],
)
def test_the_engine_refuses_cuda_it_cannot_use(model, says, request):
    """``--device cuda`` where torch sees no GPU, or for a reward model (its /classify server runs
    on the CPU): one line naming the device, exit status 2, not a silent CPU engine."""
    path = request.getfixturevalue(model)
    p = subprocess.run(
        [sys.executable, "-m", "asyncrl.engine.server", "--model", str(path)]
        + ["--port", "0", "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1] == f"asyncrl engine: {says}", p.stderr


def test_an_engine_that_may_run_on_cuda_gets_the_learners_nccl_settings():
    """Both ends of an NCCL weight group run with the settings the learner sets (SGLang's), and
    the engine's nonblocking NCCL calls are bounded by weights.timeout_s; a value set by hand is
    kept, and an engine on CPU (gloo only) gets nothing."""
    r = recipe.from_dict({"weights": {"timeout_s": 30}})
    assert engine_env(r, {}) == {**gpu.SGLANG_NCCL_ENV, gpu.NONBLOCKING_TIMEOUT: "30"}
    assert "NCCL_CUMEM_ENABLE" not in engine_env(r, {"NCCL_CUMEM_ENABLE": "1"})
    cpu = recipe.from_dict({"generator": {"device": "cpu"}})
    assert engine_env(cpu, {}) == {}
