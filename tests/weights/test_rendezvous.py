"""Which backend a weight-update group is built with (``weights.backend``), on a machine with CUDA
as on one without: the choice takes whether CUDA is available (and rank 0's GPU) as arguments, so
a CPU machine decides as a GPU host would. The members are the real ones (nothing sent); what a
member reports comes from a real engine's /server_info."""

from __future__ import annotations

import functools

import httpx
import pytest
import trio

from asyncrl import gpu
from asyncrl.generator_http import WeightsClient, async_client
from asyncrl.weights import rendezvous
from asyncrl.weights.members import Member
from asyncrl.weights.process_groups import ask_server, backend_for
from asyncrl.wire import GeneratorInfo


@pytest.mark.parametrize(
    ("cuda", "gloo_member", "expected"),
    [(True, False, "nccl"), (True, True, "gloo"), (False, False, "gloo"), (False, True, "gloo")],
)
def test_auto_is_nccl_only_on_cuda_when_every_member_can_join_it(cuda, gloo_member, expected):
    assert rendezvous.default_backend(cuda=cuda, gloo_member=gloo_member) == expected
    assert gpu.weight_backend("auto", cuda=cuda, gloo_member=gloo_member) == expected
    assert gpu.uses_nccl("auto", cuda=cuda, gloo_member=gloo_member) == (expected == "nccl")


def test_an_explicit_backend_is_kept():
    for backend in ("gloo", "nccl"):
        for cuda in (True, False):
            assert gpu.weight_backend(backend, cuda=cuda, gloo_member=False) == backend


def test_a_built_in_engine_runs_on_cuda_where_there_is_one():
    """generator.device (the engine's --device): auto is CUDA on a GPU host, the CPU elsewhere;
    cuda where torch sees no GPU is a one-line error, not a crash at the first tensor."""
    assert gpu.engine_device("auto", cuda=True) == "cuda"
    assert gpu.engine_device("auto", cuda=False) == "cpu"
    assert gpu.engine_device("cpu", cuda=True) == "cpu"
    assert gpu.engine_device("cuda", cuda=True) == "cuda"
    with pytest.raises(ValueError, match="no CUDA device"):
        gpu.engine_device("cuda", cuda=False)


def test_who_cannot_join_an_nccl_group():
    """A generator that receives on CPU, or that shares rank 0's GPU (NCCL refuses two ranks on
    one device), needs gloo; what it reports decides, and a built-in engine that reports nothing
    is one from before it ran on CUDA."""
    me = "GPU-0"
    assert gpu.needs_gloo("builtin", None, None, sender_gpu=me)
    assert gpu.needs_gloo("builtin", "cpu", None, sender_gpu=me)
    assert not gpu.needs_gloo("builtin", "cuda", "GPU-1", sender_gpu=me)
    assert gpu.needs_gloo("builtin", "cuda", me, sender_gpu=me)
    assert not gpu.needs_gloo("sglang", None, None, sender_gpu=me)
    assert gpu.needs_gloo("sglang", "cpu", None, sender_gpu=me)  # SGLang's CPU build
    # the learner's guess from the recipe, before any generator answers
    assert gpu.recipe_needs_gloo("builtin", "cpu", cuda=True)
    assert gpu.recipe_needs_gloo("builtin", "auto", cuda=False)
    assert not gpu.recipe_needs_gloo("builtin", "auto", cuda=True)
    assert not gpu.recipe_needs_gloo("sglang", "cpu", cuda=True)


def _member(
    http: httpx.AsyncClient,
    kind: str,
    port: int,
    device: str | None = None,
    gpu_uuid: str | None = None,
) -> Member:
    info = GeneratorInfo(url=f"http://127.0.0.1:{port}", kind=kind)
    m = Member(info=info, client=WeightsClient(info, http))
    m.device, m.gpu_uuid = device, gpu_uuid
    return m


def test_the_broadcaster_picks_gloo_when_a_member_cannot_join_nccl():
    """Decided per group build from what the members report: a built-in engine on CPU (or one
    that reports no device) makes the group gloo on a CUDA host; one on rank 0's own GPU takes
    handles (ipc, no group); SGLang and built-in engines on other GPUs get NCCL."""

    async def run() -> None:
        async with async_client(1.0) as http:
            member = functools.partial(_member, http)
            sglang, old = member("sglang", 1), member("builtin", 2)
            on_cpu = member("builtin", 3, "cpu")
            elsewhere, beside = (
                member("builtin", 4, "cuda", "GPU-1"),
                member("builtin", 5, "cuda", "GPU-0"),
            )
            auto = functools.partial(backend_for, "auto", cuda=True, sender_gpu="GPU-0")
            assert auto([sglang]) == "nccl"
            assert auto([sglang, elsewhere]) == "nccl"
            assert auto([elsewhere]) == "nccl"
            assert auto([sglang, old]) == "gloo"
            assert auto([elsewhere, on_cpu]) == "gloo"
            assert auto([beside]) == "ipc"
            assert auto([beside, elsewhere]) == "gloo"  # a group cannot hold both
            assert backend_for("gloo", [beside], cuda=True, sender_gpu="GPU-0") == "gloo"  # asked
            assert (
                backend_for("auto", [sglang, elsewhere], cuda=False, sender_gpu="GPU-0") == "gloo"
            )
            assert backend_for("nccl", [sglang], cuda=False, sender_gpu=None) == "nccl"

    trio.run(run)


def test_a_built_in_engine_reports_where_it_runs(rollout_engine):
    """The engine answers SGLang's /server_info with its device (and GPU), one rank and no radix
    cache; the broadcaster reads it before a group build, so an engine on CPU gets gloo even on a
    CUDA host."""
    info = GeneratorInfo(url=rollout_engine.url, kind="builtin")

    async def run() -> tuple[Member, dict | None, int]:
        async with async_client(10.0) as http:
            m = Member(info=info, client=WeightsClient(info, http))
            return m, await m.client.server_info(), await ask_server(m, "in_place")

    m, server, ranks = trio.run(run)
    assert server is not None and server["device"] == "cpu" and server["gpu_uuid"] is None
    assert server["dtype"] == "float32"  # on CPU as always, whatever model.dtype says
    assert ranks == 1  # one rank, and not refused for a radix cache
    assert m.device == "cpu" and m.gpu_uuid is None and m.needs_gloo("GPU-0")
    assert backend_for("auto", [m], cuda=True, sender_gpu="GPU-0") == "gloo"
