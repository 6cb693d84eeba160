"""The checksum of what was sent runs off rank 0's control plane loop, beside the buffer service.

The broadcaster's sender and the buffer service are tasks of one trio loop (asyncrl.control). A
checksum computed in the loop would hold every worker's request (acquire, put, status) for as long
as it hashes; a full one of an 8B model reads ~16 GB. Here a real BufferService and a real
WeightBroadcaster share a real ControlPlane, the broadcaster verifies a large state, and a real
client asks the buffer for its status all along: each answer comes within a fraction of the hash.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import trio

from asyncrl.buffer.client import BufferClient
from asyncrl.buffer.service import BufferService
from asyncrl.control import ControlPlane
from asyncrl.recipe import BufferConfig, WeightsConfig
from asyncrl.weights import buckets
from asyncrl.weights.broadcaster import WeightBroadcaster
from asyncrl.weights.snapshot import Snapshot
from asyncrl.weights.sync import SyncReport

pytestmark = pytest.mark.slow  # a second of hashing, real sockets


def _large_snapshot(tensors: int = 300) -> Snapshot:
    """A model's tensor count, each name the same 4 MiB tensor: 1.2 GB to hash fully (about a
    second on this machine), 4 MiB held."""
    big = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    names = [f"model.layers.{i}.weight" for i in range(tensors)]
    bucket = buckets.Bucket(names=names, tensors=[big] * tensors)
    return Snapshot(version=1, buckets=[bucket], payloads=[[big] * tensors], nbytes=bucket.nbytes)


def test_the_buffer_answers_while_the_checksum_of_a_large_state_runs():
    plane = ControlPlane("test-plane")
    svc = BufferService(BufferConfig(groups_per_batch=2), announce_every_s=0.2).start(plane)
    b = WeightBroadcaster(WeightsConfig(verify="full", timeout_s=10.0), rank=0, plane=plane)
    snap, report = _large_snapshot(), SyncReport(version=1)
    done = threading.Event()
    took: list[float] = []

    def verify() -> None:  # as the sender does after a version, with no generator to ask
        t0 = time.monotonic()
        try:
            plane.run(b.sync.verify, snap, report)
        finally:
            took.append(time.monotonic() - t0)
            done.set()

    latencies: list[float] = []

    async def probe() -> None:
        async with BufferClient(svc.address, worker_id="probe") as c:
            await c.status()  # connected before the checksum starts
            threading.Thread(target=verify, name="verify", daemon=True).start()
            while not done.is_set():
                t0 = time.monotonic()
                await c.status()
                latencies.append(time.monotonic() - t0)
                await trio.sleep(0.02)  # a worker's pace, not a busy loop competing for the GIL

    try:
        trio.run(probe)
        assert done.wait(60)
    finally:
        b.close()
        svc.stop()
        plane.close()
    checksum_s = took[0]
    assert report.checksum == buckets.checksum(snap.named())  # it ran, and on all of it
    assert checksum_s > 0.4, f"the checksum took {checksum_s:.2f}s: too quick to show a stall"
    # in the loop, a status sent during the hash waits for its end: one answer, ~checksum_s late
    assert len(latencies) >= 5, (latencies, checksum_s)
    assert max(latencies) < checksum_s / 3, (max(latencies), checksum_s)
