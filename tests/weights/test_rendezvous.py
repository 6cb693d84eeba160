"""Which backend a weight-update group is built with (``weights.backend``), on a machine with CUDA
as on one without: the choice takes whether CUDA is available as an argument, so a CPU machine
decides as a GPU host would. The broadcaster and its members are the real ones (rank 1: no sender
task, nothing sent)."""

from __future__ import annotations

import pytest

from asyncrl import gpu
from asyncrl.generator_http import WeightsClient
from asyncrl.recipe import WeightsConfig
from asyncrl.weights import rendezvous
from asyncrl.weights.broadcaster import Member, WeightBroadcaster
from asyncrl.wire import GeneratorInfo


@pytest.mark.parametrize(
    ("cuda", "builtin", "expected"),
    [(True, False, "nccl"), (True, True, "gloo"), (False, False, "gloo"), (False, True, "gloo")],
)
def test_auto_is_nccl_only_on_cuda_without_a_built_in_engine(cuda, builtin, expected):
    assert rendezvous.default_backend(cuda=cuda, builtin=builtin) == expected
    assert gpu.weight_backend("auto", cuda=cuda, builtin=builtin) == expected
    assert gpu.uses_nccl("auto", cuda=cuda, builtin=builtin) == (expected == "nccl")


def test_an_explicit_backend_is_kept():
    for backend in ("gloo", "nccl"):
        for cuda in (True, False):
            assert gpu.weight_backend(backend, cuda=cuda, builtin=False) == backend


def _member(kind: str, port: int) -> Member:
    info = GeneratorInfo(url=f"http://127.0.0.1:{port}", kind=kind)
    return Member(info=info, client=WeightsClient(info, timeout_s=1.0))


def test_the_broadcaster_picks_gloo_when_a_group_holds_a_built_in_engine():
    """Decided per group build from the members' kinds (as workers register them): one built-in
    engine among SGLang servers makes the group gloo on a CUDA host; without it, NCCL."""
    b = WeightBroadcaster(WeightsConfig(backend="auto"), rank=1)
    sglang, builtin = _member("sglang", 1), _member("builtin", 2)
    try:
        assert b._backend_for([sglang], cuda=True) == "nccl"
        assert b._backend_for([sglang, builtin], cuda=True) == "gloo"
        assert b._backend_for([builtin], cuda=True) == "gloo"
        assert b._backend_for([sglang, builtin], cuda=False) == "gloo"
        explicit = WeightBroadcaster(WeightsConfig(backend="nccl"), rank=1)
        assert explicit._backend_for([sglang], cuda=False) == "nccl"
    finally:
        sglang.client.close()
        builtin.client.close()
        b.close()
