"""A weight group's port is rank 0's from before any generator is told it.

Rank 0 used to find a free port (bind port 0, close), tell the generators, and bind it again in its
rendezvous thread, which runs beside those calls: in between, another run or test on the machine
could take the port, and the group build failed. The generator here is a real built-in engine in
its own process, over real HTTP and a real gloo group; its client is the real one, wrapped to look
at the port at the moment the engine is told it (nothing else can see that moment)."""

from __future__ import annotations

import socket

import pytest
import trio

from asyncrl.engine import start_engine_process
from asyncrl.generator_http import GroupSpec, WeightsClient, async_client
from asyncrl.recipe import WeightsConfig
from asyncrl.weights.fanout import FanOut
from asyncrl.weights.members import Member, Members
from asyncrl.weights.process_groups import Groups
from asyncrl.wire import GeneratorInfo

pytestmark = pytest.mark.slow


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except ConnectionRefusedError:
        return False


class _Watched(WeightsClient):
    """The real client; notes whether rank 0 listens on the group's port when the call is made."""

    told: list[bool]

    async def init_group(self, spec: GroupSpec, *, rank_offset: int) -> None:
        self.told.append(_listening(spec.master_address, spec.master_port))
        await super().init_group(spec, rank_offset=rank_offset)


def test_rank_0_listens_on_the_group_port_before_a_generator_is_told_it(tiny_qwen3):
    ep = start_engine_process(tiny_qwen3, weight_version="0", timeout_s=120)
    cfg = WeightsConfig(timeout_s=30.0)
    built: list[dict] = []

    async def run() -> None:
        async with async_client(cfg.timeout_s) as http, trio.open_nursery() as nursery:
            info = GeneratorInfo(url=ep.url, kind="builtin")
            client = _Watched(info, http)
            client.told = []
            member = Member(info=info, client=client)
            groups = Groups(
                cfg,
                Members(lambda i: WeightsClient(i, http)),
                FanOut(nice=False),
                sender_gpu=None,
                on_event=lambda name, **f: built.append(f),
            )
            groups.background = nursery
            await groups.build([member])
            try:
                assert client.told == [True]
                assert groups.urls() == [ep.url] and groups.backend(ep.url) == "gloo"
            finally:
                await groups.drop([ep.url], background=False)

    try:
        trio.run(run)
    finally:
        ep.stop()
    assert len(built) == 1 and built[0]["url"] == ep.url
