"""Rank 0's control plane: tasks of one nursery in one background thread, called from outside."""

from __future__ import annotations

import threading

import pytest
import trio

from asyncrl.control import ControlPlane


def test_tasks_share_one_loop_and_the_caller_talks_to_them() -> None:
    plane = ControlPlane("test-plane")
    send, recv = trio.open_memory_channel[int](0)
    seen: list[tuple[str, int]] = []

    async def consumer(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started("ready")
        async for x in recv:
            seen.append((threading.current_thread().name, x))

    try:
        assert plane.start(consumer, name="consumer") == "ready"
        plane.run(send.send, 7)  # from this thread into a task, over a channel
        plane.run(send.send, 8)  # the first one has been received: the channel holds none
        assert plane.run_sync(lambda: threading.current_thread().name) == "test-plane"
        assert seen[0] == ("test-plane", 7)
    finally:
        plane.close()
    assert not plane.alive and plane.failure is None
    plane.close()  # idempotent


def test_a_failing_task_ends_the_plane_and_its_error_is_kept() -> None:
    plane = ControlPlane("test-plane")
    stopped = threading.Event()

    async def sibling(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            stopped.set()  # cancelled with the plane

    async def broken(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep(0.01)
        raise ValueError("boom")

    plane.start(sibling, name="sibling")
    plane.start(broken, name="broken")
    assert stopped.wait(10)
    plane.close()
    assert not plane.alive and "boom" in repr(plane.failure)
    with pytest.raises(RuntimeError, match="test-plane has stopped"):
        plane.run_sync(lambda: None)
