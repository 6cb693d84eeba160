"""`asyncrl doctor` against real SGLang 0.5.23: the server checks pass on the tier's servers (radix
cache off, a numeric label), their logprobs at T = 0.7 are the learner's log softmax(z/T), and a
server launched with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (slime's launch scripts set it) is named
as such: the semantics the built-in engine mirrors, seen on SGLang itself."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import START_TIMEOUT_S
from sglang_helpers import TOL, Served, healthy, served_model_dir

from asyncrl import gpu
from asyncrl import recipe as recipe_mod
from asyncrl.doctor import (
    Check,
    Doctor,
    check_device,
    check_generators,
    check_logprobs,
    check_model,
)
from tools.sglang_cpu.server import SGLangServer

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).resolve().parents[2]


def _doctor_checks(model: Path, url: str) -> tuple[Check, Check]:
    """(the server's check, its logprob check) for the demo recipe on ``model`` at T = 0.7."""
    r = recipe_mod.load(
        ROOT / "recipes/demo.yaml",
        [
            f"model.path={model}",
            "generator.kind=sglang",
            f"generator.urls=[{url}]",
            "rollout.temperature=0.7",
        ],
        check_files=False,
    )
    d = Doctor(recipe=r, timeout_s=120)
    check_model(d)
    check_device(d)
    (server,) = check_generators(d)
    (logprobs,) = check_logprobs(d)
    return server, logprobs


def _mean_gaps(detail: str) -> list[float]:
    return [float(x) for x in re.findall(r"mean \|Δ\| ([0-9.e+-]+)[);]", detail)]


def test_the_doctor_passes_real_sglang_at_the_temperature(served: Served, tmp_path):
    server, c = _doctor_checks(served_model_dir(served, tmp_path / "model"), served.url)
    assert server.ok and "sglang 0.5.23, tp 1, radix cache off" in server.detail, server.detail
    assert c.ok and "its logprobs are the learner's log softmax(z/T)" in c.detail, c.detail
    (gap,) = _mean_gaps(c.detail)
    assert gap <= TOL


@pytest.fixture(scope="module")
def original_logprob_server(sglang_python, tiny_qwen3, tmp_path_factory):
    server = SGLangServer(
        python=sglang_python,
        model=tiny_qwen3,
        log=tmp_path_factory.getbasetemp() / "sglang_original_logprob.log",
        extra_args=["--disable-radix-cache"],
        env={"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"},
    )
    yield from healthy(server, START_TIMEOUT_S)


def test_the_doctor_names_sglang_return_original_logprob(original_logprob_server, tiny_qwen3):
    _, c = _doctor_checks(tiny_qwen3, original_logprob_server.url)
    assert not c.ok, c.detail
    assert "its logprobs equal the untempered log softmax(z)" in c.detail
    assert "it runs with SGLANG_RETURN_ORIGINAL_LOGPROB=1" in c.detail
    untempered, tempered = _mean_gaps(c.detail)
    assert untempered <= TOL and tempered > 4 * untempered


def test_the_nccl_of_sglangs_own_environment_is_read(sglang_python):
    """SGLang 0.5.23's environment (torch 2.14.1's CUDA wheel, which imports on CPU) carries the
    NCCL the pin table says; this CPU-only environment carries none. In this tier, whose set-up
    builds that environment (in the default tier it skipped on every fresh machine, CI's)."""
    t = gpu.probe_python(str(sglang_python))
    assert t.torch.startswith("2.14.1") and t.nccl == gpu.expected_nccl("0.5.23")
    import torch

    if torch.version.cuda is None:  # asyncrl's CPU venv: no NCCL to compare with
        assert gpu.this_torch().nccl is None
