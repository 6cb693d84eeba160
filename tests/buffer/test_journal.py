"""The buffer's journal: an acknowledged group survives a learner that dies between checkpoints."""

from __future__ import annotations

import dataclasses
import json

import trio

from asyncrl.buffer.client import BufferClient
from asyncrl.buffer.service import BufferService
from asyncrl.recipe import BufferConfig
from tests.buffer.test_store import make_group


def config() -> BufferConfig:
    return BufferConfig(groups_per_batch=2, max_staleness=1, lease_seconds=30, batch_timeout_s=10)


async def _put(address: str, ids: list[str]) -> list[str]:
    async with BufferClient(address, worker_id="w") as c:
        grant = await c.acquire(len(ids))
        assert grant.starts == len(ids)
        ack = await c.put(
            [make_group(i, grant.lease_id, versions=[grant.version] * 2) for i in ids]
        )
        return ack.group_ids


def test_groups_acked_after_the_checkpoint_are_readmitted_once(tmp_path) -> None:
    journal = tmp_path / "buffer"
    first = BufferService(config(), journal_dir=journal).start()
    try:
        assert trio.run(_put, first.address, ["a", "b"]) == ["a", "b"]
        assert [g.id for g in first.next_batch(5).groups] == ["a", "b"]
        first.set_version(1)
        state = json.loads(json.dumps(first.state_dict()))  # the checkpoint at version 1
        assert trio.run(_put, first.address, ["c", "d"]) == ["c", "d"]  # acked, then the crash
        assert [g.id for g in first.next_batch(5).groups] == ["c", "d"]
        first.set_version(2)  # trained into version 2, which the crash loses
    finally:
        first.stop()
    second = BufferService(config(), state=state, journal_dir=journal).start()
    try:
        stats = second.stats()
        assert stats["readmitted"] == 2 and stats["occupancy"] == 2 and second.version == 1
        assert [g.id for g in second.next_batch(5).groups] == ["c", "d"]  # "a", "b": once only
        second.set_version(2)
        state2 = second.state_dict()
    finally:
        second.stop()
    third = BufferService(config(), state=state2, journal_dir=journal).start()
    try:
        assert third.stats()["readmitted"] == 2 and third.stats()["occupancy"] == 0  # cumulative
    finally:
        third.stop()
    audit = [json.loads(x) for x in (journal / "trained.jsonl").read_text().splitlines()]
    assert [r.get("start", r.get("version", r.get("stop"))) for r in audit] == [
        0,
        1,
        2,
        2,
        1,
        2,
        2,
        2,
        2,
    ]
    assert audit[4]["readmitted"] == {"stored": 2}
    # a new run in the same folder does not inherit the old run's acknowledgements
    fresh = BufferService(config(), journal_dir=journal, journal_resume=False)
    assert fresh.stats()["occupancy"] == 0


def test_generators_registered_after_the_checkpoint_are_known_after_a_restart(tmp_path) -> None:
    """A worker restarted (new engine, new URL) after the checkpoint: the restored service tells
    the broadcaster of the new generator, not only of the one the checkpoint saw."""
    from asyncrl import wire

    journal = tmp_path / "buffer"
    old, new = (
        wire.GeneratorInfo(url="http://127.0.0.1:1001"),
        wire.GeneratorInfo(url="http://127.0.0.1:1002"),
    )

    async def register(address: str, gen: wire.GeneratorInfo) -> None:
        async with BufferClient(address, worker_id="w") as c:
            await c.register([gen])

    first = BufferService(config(), journal_dir=journal).start()
    try:
        trio.run(register, first.address, old)
        state = json.loads(json.dumps(first.state_dict()))  # the checkpoint
        trio.run(register, first.address, new)  # then the crash
    finally:
        first.stop()
    assert state["registered"] == {"w": [dataclasses.asdict(old)]}
    seen: list = []
    with BufferService(config(), state=state, journal_dir=journal) as second:
        second.on_register(lambda wid, gens: seen.append((wid, [g.url for g in gens])))
        assert seen == [("w", [new.url])]
        assert second.state_dict()["registered"] == {"w": [dataclasses.asdict(new)]}
    # a new run (not resumed) does not inherit them
    seen.clear()
    with BufferService(config(), journal_dir=journal, journal_resume=False) as fresh:
        fresh.on_register(lambda wid, gens: seen.append(wid))
        assert seen == [] and not (journal / "registered.json").exists()
