"""The rollout worker against the real built-in engine and a real buffer on loopback nng."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from dataclasses import dataclass

import numpy as np
import pytest
import rollout_plugins
import trio

from asyncrl import wire
from asyncrl.recipe import BufferConfig
from asyncrl.rollout.client import GeneratorPool, SamplingParams
from asyncrl.rollout.data import PromptSource
from asyncrl.rollout.rewards import RewardRunner, load_reward
from asyncrl.rollout.worker import BufferLink, RolloutWorker, WorkerConfig
from asyncrl.rollout.workflows import SingleTurn, load_workflow
from asyncrl.transport import Publisher, RepServer, ReqClient, Subscriber

WAIT_S = 60.0  # generous bound for "should happen": the machine is loaded


@pytest.fixture
def engine(rollout_engine):
    return rollout_engine


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3)


@dataclass
class Buffer:
    store: object
    address: str
    pub: Publisher
    server: RepServer

    def stored(self) -> list[wire.Group]:
        return [self.store._stored[gid].group for gid in self.store.stored_ids()]

    async def set_version(self, v: int) -> None:
        self.store.set_version(v)
        await self.pub.publish(wire.Version(version=v))


@asynccontextmanager
async def serve_buffer(cfg: BufferConfig, *, proxy=None):
    from asyncrl.buffer.store import ReplayStore

    store = ReplayStore(cfg)

    def handle(msg):
        now = trio.current_time()
        if isinstance(msg, wire.Acquire):
            return store.acquire(msg.worker_id, msg.n, now=now)
        if isinstance(msg, wire.Put):
            return store.put(msg.groups, now=now)
        if isinstance(msg, wire.Release):
            return store.release(msg.lease_id, msg.n, now=now)
        if isinstance(msg, wire.Register):
            return wire.Ok(version=store.version)
        return wire.Error(code="unexpected", message=msg.kind)

    async with trio.open_nursery() as n:
        with RepServer("tcp://127.0.0.1:0") as server, Publisher("tcp://127.0.0.1:0") as pub:
            server.listen()
            pub.listen()
            n.start_soon(server.serve, handle)
            yield Buffer(store=store, address=server.address, pub=pub, server=server)
            n.cancel_scope.cancel()


def rows(n=16):
    return [{"prompt": f"{i:02d}+{i:02d}=", "answer": str(2 * i)} for i in range(n)]


@asynccontextmanager
async def make_worker(
    engine,
    tokenizer,
    buffer_address,
    pub_address=None,
    *,
    reward="exact_match",
    reward_timeout_s=10.0,
    workflow=None,
    max_new_tokens=12,
    **cfg,
):
    cfg = {
        "worker_id": "w0",
        "group_size": 3,
        "max_concurrent_groups": 2,
        "max_staleness": 0,
        **cfg,
    }
    with ReqClient(buffer_address) as req:
        sub = Subscriber(pub_address) if pub_address else None
        try:
            async with GeneratorPool([engine.url]) as pool:
                yield RolloutWorker(
                    WorkerConfig(**cfg),
                    buffer=BufferLink(req, worker_id=cfg["worker_id"], timeout_s=2.0),
                    pool=pool,
                    source=PromptSource(rows(), name="rows.jsonl", seed=0),
                    tokenizer=tokenizer,
                    workflow=workflow or SingleTurn(),
                    reward=RewardRunner(load_reward(reward), timeout_s=reward_timeout_s),
                    params=SamplingParams(max_new_tokens=max_new_tokens),
                    subscriber=sub,
                    generators=[wire.GeneratorInfo(url=engine.url, kind="builtin")],
                )
        finally:
            if sub is not None:
                sub.close()


async def wait_for(cond, what: str):
    with trio.fail_after(WAIT_S):
        while not cond():
            await trio.sleep(0.02)


def check_group(g: wire.Group, n: int):
    assert len(g.samples) == n
    for s in g.samples:
        k = len(s.completion_ids)
        assert k > 0
        assert len(s.behavior_logprobs) == len(s.versions) == len(s.loss_mask) == k
        assert s.group_id == g.id and s.finish_reason in ("stop", "length")
        assert (s.behavior_logprobs <= 0).all()


def test_never_more_groups_in_flight_than_granted(engine, tokenizer):
    """eta = 0 and 2 groups per batch: the buffer grants 2 starts per version, no more."""
    cfg = BufferConfig(groups_per_batch=2, max_staleness=0, lease_seconds=60)

    async def go():
        async with serve_buffer(cfg) as buf:
            async with make_worker(
                engine, tokenizer, buf.address, buf.pub.address, max_concurrent_groups=4
            ) as w:
                async with trio.open_nursery() as n:
                    n.start_soon(w.run)
                    # version 0 admits exactly 2 groups; the worker then waits on grants of 0
                    await wait_for(lambda: len(buf.stored()) == 2, "2 groups stored")
                    await wait_for(lambda: w.stats.counters["grants_zero"] >= 2, "admission wait")
                    assert w.stats.counters["groups_started"] == 2
                    # a new version (published on Pub/Sub) admits 2 more
                    await buf.set_version(1)
                    await wait_for(lambda: w.stats.counters["groups_delivered"] == 4, "4 groups")
                    w.stop()
                return buf.stored(), buf.store.stats(), w.stats

    stored, stats, ws = trio.run(go)
    assert ws.max_in_flight_over_granted <= 0
    assert ws.peak_groups_in_flight <= 2
    assert ws.counters["groups_started"] == 4
    assert stats["stored_total"] == 4 and stats["duplicates"] == 0
    for g in stored:
        check_group(g, 3)
        assert all((s.loss_mask == 1).all() for s in g.samples)
        assert json.dumps(g.metadata["data_state"])  # the data position travels with the group


@asynccontextmanager
async def dropping_proxy(upstream: str, drop_puts: int):
    """A FAULT INJECTOR, not a buffer: forwards every request to the real buffer service but
    swallows the replies to the first ``drop_puts`` puts (the buffer stored them, the worker never
    hears so). Only this proxy is fake; the buffer behind it is real."""
    dropped = {"n": 0}
    never = trio.Event()

    async with trio.open_nursery() as n:
        with ReqClient(upstream) as up, RepServer("tcp://127.0.0.1:0", concurrency=16) as proxy:
            proxy.listen()

            async def handle(msg):
                reply = await up.request(msg, timeout_s=10)
                if isinstance(msg, wire.Put) and dropped["n"] < drop_puts:
                    dropped["n"] += 1
                    await never.wait()  # no reply: the worker's put times out
                return reply

            n.start_soon(proxy.serve, handle)
            yield proxy.address, dropped
            n.cancel_scope.cancel()


def test_unacked_groups_are_resent_and_stored_once(engine, tokenizer):
    cfg = BufferConfig(groups_per_batch=4, max_staleness=0, lease_seconds=60)

    async def go():
        async with (
            serve_buffer(cfg) as buf,
            dropping_proxy(buf.address, drop_puts=2) as (
                addr,
                dropped,
            ),
        ):
            async with make_worker(
                engine, tokenizer, addr, max_concurrent_groups=2, max_groups=4, put_batch=1
            ) as w:
                stats = await w.run()
            return buf.stored(), buf.store.stats(), stats, dropped["n"]

    stored, stats, ws, dropped = trio.run(go)
    assert dropped == 2
    assert ws.counters["put_resends"] >= 2
    assert ws.counters["groups_delivered"] == 4
    ids = [g.id for g in stored]
    assert len(ids) == len(set(ids)) == stats["stored_total"] == 4
    assert stats["duplicates"] >= 2  # the resends reached the buffer and were recognised


def test_failing_rewards_are_recorded_and_the_worker_goes_on(engine, tokenizer):
    cfg = BufferConfig(groups_per_batch=8, max_staleness=0, lease_seconds=60)

    async def run(reward, timeout):
        async with serve_buffer(cfg) as buf:
            async with make_worker(
                engine,
                tokenizer,
                buf.address,
                reward=reward,
                reward_timeout_s=timeout,
                max_groups=2,
            ) as w:
                stats = await w.run()
            return buf.stored(), stats

    for reward, timeout, why in [
        ("rollout_plugins:raising_reward", 10.0, "ValueError: this reward is broken on purpose"),
        ("rollout_plugins:sleeping_reward", 0.3, "timed out after 0.3s"),
    ]:
        rollout_plugins.RELEASE.clear()
        try:
            stored, ws = trio.run(run, reward, timeout)
        finally:
            rollout_plugins.RELEASE.set()
        assert ws.counters["groups_delivered"] == 2
        assert ws.counters["reward_failures"] == 6
        for g in stored:
            for s in g.samples:
                assert s.reward == 0.0 and why in s.metadata["reward_failure"]


def test_groups_that_became_stale_are_cancelled_and_released(engine, tokenizer):
    """eta = 0: a version announced while a group generates makes it untrainable; the worker
    cancels it, gives its start back, and starts replacements under the new version."""
    cfg = BufferConfig(groups_per_batch=2, max_staleness=0, lease_seconds=60)

    async def go():
        async with serve_buffer(cfg) as buf:
            async with make_worker(
                engine, tokenizer, buf.address, buf.pub.address, max_new_tokens=400
            ) as w:
                async with trio.open_nursery() as n:
                    n.start_soon(w.run)
                    await wait_for(lambda: w._episodes_in_flight > 0, "episodes running")
                    assert w.stats.counters["groups_started"] == 2
                    await buf.set_version(1)
                    await wait_for(
                        lambda: w.stats.counters["groups_cancelled_stale"] == 2, "cancelled"
                    )
                    await wait_for(lambda: w.stats.counters["groups_started"] == 4, "replaced")
                    assert w.stats.counters["groups_delivered"] == 0
                    w.stop()
                return buf.store.stats(), w.stats

    stats, ws = trio.run(go)
    assert stats["closed_stale"] == 2  # the buffer took the stale starts back as well
    assert stats["stored_total"] == 0
    assert ws.max_in_flight_over_granted <= 0


def test_multi_turn_groups_through_the_worker(engine, tokenizer):
    cfg = BufferConfig(groups_per_batch=4, max_staleness=0, lease_seconds=60)

    async def go():
        async with serve_buffer(cfg) as buf:
            async with make_worker(
                engine,
                tokenizer,
                buf.address,
                workflow=load_workflow("rollout_plugins:tool_workflow"),
                reward="rollout_plugins:length_reward",
                max_new_tokens=80,
                max_groups=2,
            ) as w:
                await w.run()
            return buf.stored()

    stored = trio.run(go)
    assert len(stored) == 2
    for g in stored:
        check_group(g, 3)
        for s in g.samples:
            assert len(s.metadata["tool_calls"]) == 2
            mask = s.loss_mask.astype(int)
            # tool output is masked, and it is exactly the `<result>...</result>` text
            masked = tokenizer.decode(s.completion_ids[mask == 0].tolist())
            assert masked.count("<result>") == 2 and masked.endswith("</result>\n")
            assert (s.behavior_logprobs[mask == 0] == 0).all()
            assert np.isfinite(s.reward) and s.reward == len(s.completion_ids)
