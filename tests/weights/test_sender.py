"""The sender's state machine (asyncrl.weights.sender) with fake versions: a job is an async
function that waits until the test lets it finish, a hold a blocking function that waits on a
threading event. No process, no tensor; each wait is bounded, so a sender that keeps a hand-over
waiting fails in a second instead of hanging."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing

from asyncrl.weights.sender import Sender

BOUND_S = 1.0


class Versions:
    """Fake jobs: version ``v``'s job records that it started, waits for ``finish(v)``, returns v."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.gates: dict[int, trio.Event] = {}

    def job(self, v: int) -> Callable[[], Awaitable[int]]:
        self.gates[v] = trio.Event()

        async def run() -> int:
            self.started.append(v)
            await self.gates[v].wait()
            return v

        return run

    def finish(self, v: int) -> None:
        self.gates[v].set()


class Hold:
    """A blocking hold that returns once the test opens it; ``calls``: what it was called with."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.calls: list[object] = []

    def __call__(self, *args: object) -> None:
        self.calls.append(args[0] if args else None)
        assert self.gate.wait(BOUND_S * 5)


def run(test: Callable[[Sender, trio.Nursery], Awaitable[None]], sender: Sender) -> None:
    async def main() -> None:
        with trio.fail_after(BOUND_S):
            async with trio.open_nursery() as nursery:
                await nursery.start(sender.serve)
                await test(sender, nursery)
                await sender.wait_idle(BOUND_S)
                sender.close()

    trio.run(main)


def test_a_version_handed_over_while_one_is_in_flight_waits_for_it():
    versions = Versions()
    handed: list[int] = []

    async def test(sender: Sender, nursery: trio.Nursery) -> None:
        await sender.hand_over(1, versions.job(1))
        await trio.testing.wait_all_tasks_blocked()
        assert versions.started == [1] and sender.running

        async def hand_over_2() -> None:
            await sender.hand_over(2, versions.job(2))
            handed.append(2)

        nursery.start_soon(hand_over_2)
        await trio.testing.wait_all_tasks_blocked()
        assert handed == [] and versions.started == [1]  # at most one version in flight
        versions.finish(1)
        await trio.testing.wait_all_tasks_blocked()
        assert handed == [2] and versions.started == [1, 2]
        versions.finish(2)

    sender = Sender()
    run(test, sender)
    assert sender.skipped == 0 and sender.last_version == 2 and not sender.running


def test_during_the_hold_after_a_version_the_newest_one_waits_and_replaces_the_pending_one():
    versions = Versions()
    after = Hold()

    async def test(sender: Sender, nursery: trio.Nursery) -> None:
        await sender.hand_over(1, versions.job(1))
        versions.finish(1)
        while not after.calls:  # version 1 is out and the hold runs (in a worker thread)
            await trio.sleep(0)
        # the generators are held: hand-overs return at once, the newest one pending
        await sender.hand_over(2, versions.job(2))
        await sender.hand_over(3, versions.job(3))
        await trio.testing.wait_all_tasks_blocked()
        assert versions.started == [1] and sender.skipped == 1 and sender.last_version == 3
        after.gate.set()  # the hold ends: the pending version goes out, the skipped one never
        while versions.started == [1]:
            await trio.sleep(0)
        assert versions.started == [1, 3]
        versions.finish(3)

    sender = Sender(after)
    run(test, sender)
    assert after.calls == [1, 3] and versions.started == [1, 3]


def test_a_hold_keeps_the_next_version_back_until_it_returns():
    versions = Versions()
    hold = Hold()

    async def test(sender: Sender, nursery: trio.Nursery) -> None:
        await sender.hold(hold)
        while not hold.calls:
            await trio.sleep(0)
        await sender.hand_over(1, versions.job(1))  # returns: pending, not waiting on the hold
        await trio.testing.wait_all_tasks_blocked()
        assert versions.started == [] and sender.running
        hold.gate.set()
        while not versions.started:
            await trio.sleep(0)
        assert versions.started == [1]
        versions.finish(1)

    sender = Sender()
    run(test, sender)
    assert hold.calls == [None] and sender.skipped == 0


class Boom(Exception):
    pass


def test_a_hand_over_never_waits_on_a_stopped_sender():
    """A job that raises stops the sender; the next hand-over fails at once instead of waiting
    for a version that will never be out (the training thread would hang in publish)."""
    sender = Sender()

    async def failing() -> int:
        raise Boom

    async def serve(task_status=trio.TASK_STATUS_IGNORED) -> None:
        with pytest.raises(Boom):
            await sender.serve(task_status=task_status)

    async def main() -> None:
        with trio.fail_after(BOUND_S):
            async with trio.open_nursery() as nursery:
                await nursery.start(serve)
                await sender.hand_over(1, failing)
            assert not sender.running and await sender.wait_idle(BOUND_S)
            with pytest.raises(trio.BrokenResourceError):
                await sender.hand_over(2, Versions().job(2))
            with pytest.raises(trio.BrokenResourceError):
                await sender.hold(Hold())
            with pytest.raises(trio.BrokenResourceError):  # not kept as pending behind that hold
                await sender.hand_over(3, Versions().job(3))

    trio.run(main)
