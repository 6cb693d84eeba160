"""A generator lost in the middle of a weight update: the learner's broadcaster neither hangs nor
fails, it drops the generator within its timeout and goes on. These tests kill their server, so
they run after every other test of the tier (fixture ``doomed``)."""

from __future__ import annotations

import signal
import time
import uuid

import pytest
import trio
from sglang_helpers import Served, perturbed

from asyncrl.generator_http import GeneratorError, WeightsClient, async_client
from asyncrl.recipe import WeightsConfig
from asyncrl.weights.broadcaster import WeightBroadcaster
from asyncrl.wire import GeneratorInfo

pytestmark = pytest.mark.sglang

TIMEOUT_S = 5.0


def _publish_and_lose(served: Served, doomed, sig: int) -> tuple[WeightBroadcaster, float]:
    """Publish a version; ``sig`` hits the server's process group right after the first bucket."""

    def on_event(name: str, fields: dict) -> None:
        if name == "bucket_sent" and fields["index"] == 0:
            doomed(served, sig)

    cfg = WeightsConfig(
        timeout_s=TIMEOUT_S, overlap=False, bucket_mb=0.05, group_name=f"t-{uuid.uuid4().hex[:8]}"
    )
    b = WeightBroadcaster(cfg, rank=0, on_event=on_event)
    b.add_generator(GeneratorInfo(url=served.url))
    v = served.version + 1
    t0 = time.monotonic()
    b.publish(v, perturbed(served.weights, seed=3000 + v, tied=served.tied))
    return b, time.monotonic() - t0


def _check_dropped(b: WeightBroadcaster, served: Served, elapsed: float) -> None:
    r = b.reports[-1]
    assert r.dropped == [served.url] and r.updated == [] and r.error, r
    assert b.generators() == {served.url: "dropped"}
    # bounded: the failed bucket (HTTP 2 x timeout + 5 s) plus the probes (5 s each)
    assert elapsed < 6 * TIMEOUT_S + 30, f"publish took {elapsed:.0f}s"


def _check_next_version_is_quick(b: WeightBroadcaster, served: Served) -> None:
    """The next version finds no live generator and says so; close() returns."""
    t0 = time.monotonic()
    b.publish(served.version + 2, served.weights)
    r = b.reports[-1]
    assert r.updated == [] and r.error == "no generators", r
    b.close()
    assert time.monotonic() - t0 < 3 * TIMEOUT_S + 10


def test_server_killed_mid_update(qwen3: Served, doomed):
    """SIGKILL after the first bucket: the connection resets, the generator is dropped."""
    b, elapsed = _publish_and_lose(qwen3, doomed, signal.SIGKILL)
    _check_dropped(b, qwen3, elapsed)

    async def ask() -> bool:
        async with async_client(2.0) as http:
            client = WeightsClient(GeneratorInfo(url=qwen3.url), http)
            with pytest.raises(GeneratorError) as e:
                await client.model_info()
            assert e.value.dead
            return await client.health()

    assert trio.run(ask) is False
    _check_next_version_is_quick(b, qwen3)


def test_server_hung_mid_update_times_out(llama: Served, doomed):
    """SIGSTOP after the first bucket (alive, silent): the broadcaster times out and drops it; then
    the server is killed for good while frozen."""
    b, elapsed = _publish_and_lose(llama, doomed, signal.SIGSTOP)
    _check_dropped(b, llama, elapsed)
    llama.server.signal_group(signal.SIGKILL)
    _check_next_version_is_quick(b, llama)
