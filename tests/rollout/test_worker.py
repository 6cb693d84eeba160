"""The rollout worker against the real built-in engine and a real buffer on loopback nng."""

from __future__ import annotations

import dataclasses
from contextlib import asynccontextmanager, contextmanager

import numpy as np
import pytest
import trio

from asyncrl import wire
from asyncrl.buffer.client import BufferClient
from asyncrl.recipe import BufferConfig
from asyncrl.rewards import RewardRunner, load_reward
from asyncrl.rollout.generator_pool import GeneratorPool
from asyncrl.rollout.prompts import PromptSource
from asyncrl.rollout.sglang_protocol import SamplingParams
from asyncrl.rollout.worker import RolloutWorker, WorkerError
from asyncrl.rollout.worker_config import WorkerConfig
from asyncrl.rollout.workflows import SingleTurn, load_workflow
from asyncrl.transport import RepServer, ReqClient, Subscriber
from tests import rollout_plugins
from tests.labels import get_label, set_label

WAIT_S = 60.0  # generous bound for "should happen": the machine is loaded


@pytest.fixture
def engine(rollout_engine):
    """The shared engine as launched (it says "default"; the worker labels it "0" when it joins)."""
    set_label(rollout_engine.url, "default")
    yield rollout_engine
    set_label(rollout_engine.url, "default")


async def new_version(svc, engine, v: int) -> None:
    """What the learner does for version ``v``: its broadcaster updates the generators, whose label
    says ``v`` (the weights stay the same here: these tests are about admission, not learning),
    then the buffer announces ``v``."""
    await trio.to_thread.run_sync(set_label, engine.url, str(v))
    await trio.to_thread.run_sync(svc.set_version, v)


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3)


@contextmanager
def serve_buffer(**cfg):
    """The real buffer service (learner rank 0's), on loopback tcp with free ports. Start and stop
    it outside trio.run (it runs its own trio loop in a thread)."""
    from asyncrl.buffer.service import BufferService

    cfg = BufferConfig(
        address="tcp://127.0.0.1:0", pub_address="tcp://127.0.0.1:0", lease_seconds=60, **cfg
    )
    with BufferService(cfg, announce_every_s=0.2) as svc:
        yield svc


async def take_batch(svc) -> list[wire.Group]:
    """What the learner would get next (consumes a batch of groups_per_batch groups)."""
    batch = await trio.to_thread.run_sync(lambda: svc.next_batch(timeout_s=WAIT_S))
    return batch.groups


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
    reward_runner=None,
    teacher=None,
    **cfg,
):
    cfg = {
        "worker_id": "w0",
        "group_size": 3,
        "max_concurrent_groups": 2,
        "max_staleness": 0,
        **cfg,
    }
    sub = Subscriber(pub_address) if pub_address else None
    try:
        async with (
            BufferClient(buffer_address, worker_id=cfg["worker_id"], timeout_s=2.0) as buffer,
            GeneratorPool([engine.url]) as pool,
        ):
            yield RolloutWorker(
                WorkerConfig(**cfg),
                buffer=buffer,
                pool=pool,
                source=PromptSource(rows(), name="rows.jsonl", seed=0),
                tokenizer=tokenizer,
                workflow=workflow or SingleTurn(),
                reward=reward_runner
                or RewardRunner(load_reward(reward), timeout_s=reward_timeout_s),
                params=SamplingParams(max_new_tokens=max_new_tokens),
                subscriber=sub,
                generators=[wire.GeneratorInfo(url=engine.url, kind="builtin")],
                teacher=teacher,
            )
    finally:
        if sub is not None:
            sub.close()


async def run_to_failure(worker: RolloutWorker) -> WorkerError:
    """Run a worker that must stop on its own (within WAIT_S): the one error its nursery raises."""
    with trio.fail_after(WAIT_S), pytest.raises(ExceptionGroup) as e:
        await worker.run()
    (error,) = e.value.exceptions
    assert isinstance(error, WorkerError), error
    return error


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


def check_every_group_had_a_start(stats: dict) -> None:
    """The worker's admission invariant as the buffer saw it: every group it stored arrived under
    a live lease with a start left (none late, none refused), and every start is accounted for."""
    assert stats["late_accepted"] == 0 and stats["rejected"] == {}, stats
    assert stats["arrived"] == stats["stored_total"]
    assert stats["granted"] == (
        stats["arrived"]
        + stats["released"]
        + stats["expired"]
        + stats["closed_stale"]
        + stats["grants_in_flight"]
    )


def test_never_more_groups_in_flight_than_granted(engine, tokenizer):
    """eta = 0 and 2 groups per batch: the buffer grants 2 starts per version, no more."""

    async def go(svc):
        async with make_worker(
            engine, tokenizer, svc.address, svc.pub_address, max_concurrent_groups=4
        ) as w:
            async with trio.open_nursery() as n:
                n.start_soon(w.run)
                # version 0 admits exactly 2 groups; the worker then asks and is told to wait
                first = await take_batch(svc)
                await wait_for(lambda: svc.stats()["admission_waits"] >= 2, "admission wait")
                assert svc.stats()["granted"] == 2
                # the next version (announced on Pub/Sub) admits 2 more
                await new_version(svc, engine, 1)
                second = await take_batch(svc)
                w.stop()
            return first + second, svc.stats()

    with serve_buffer(groups_per_batch=2, max_staleness=0) as svc:
        groups, stats = trio.run(go, svc)
    check_every_group_had_a_start(stats)
    assert stats["granted"] == 4 and stats["stored_total"] == 4 and stats["duplicates"] == 0
    assert stats["staleness_max"] == 0  # batch k holds only groups started at version k
    assert len({g.id for g in groups}) == 4
    for g in groups:
        check_group(g, 3)
        assert all((s.loss_mask == 1).all() for s in g.samples)
    # the data position travels with each group; the buffer keeps the newest for a restart
    states = [g.data_state for g in groups]
    newest = max(states, key=lambda st: st["seq"])
    assert stats["data_states"] == {"w0": newest}
    assert newest["num_rows"] == len(rows()) and newest["next_index"] >= 4
    for g, st in zip(groups, states, strict=True):
        assert g.prompt_index < st["next_index"] and g.prompt_index not in st["outstanding"]


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
    async def go(svc):
        async with dropping_proxy(svc.address, drop_puts=2) as (addr, dropped):
            async with make_worker(
                engine, tokenizer, addr, max_concurrent_groups=2, max_groups=4, put_batch=1
            ) as w:
                stats = await w.run()
        return await take_batch(svc), svc.stats(), stats, dropped["n"]

    with serve_buffer(groups_per_batch=4, max_staleness=0) as svc:
        groups, stats, ws, dropped = trio.run(go, svc)
    assert dropped == 2
    ids = [g.id for g in groups]
    assert len(set(ids)) == stats["stored_total"] == 4
    assert stats["duplicates"] >= 2  # the resends reached the buffer and were recognised
    check_every_group_had_a_start(stats)


@pytest.mark.parametrize(
    ("reward", "timeout", "why"),
    [
        ("first_of_three_raises", 10.0, "ValueError: this reward is broken on purpose"),
        ("first_of_three_sleeps", 2.0, "timed out after 2s"),
    ],
)
def test_a_failed_reward_leaves_its_sample_out_and_the_group_goes_on(
    engine, tokenizer, caplog, reward, timeout, why
):
    """A reward that raises, or runs past rollout.reward_timeout_s, on one sample of each group of
    3 (made one at a time): that sample is not sent, with a 0 or any reward; the group is, with the
    other two, so its advantages are computed over them alone; the failures are counted and
    logged."""
    from asyncrl.learner.advantages import compute_advantages

    async def run(svc):
        async with make_worker(
            engine,
            tokenizer,
            svc.address,
            reward=f"tests.rollout_plugins:{reward}",
            reward_timeout_s=timeout,
            max_concurrent_groups=1,
            max_groups=2,
        ) as w:
            stats = await w.run()
        return await take_batch(svc), stats.counters

    rollout_plugins.reset_calls()
    rollout_plugins.RELEASE.clear()
    try:
        with serve_buffer(groups_per_batch=2, max_staleness=0) as svc:
            groups, c = trio.run(run, svc)
    finally:
        rollout_plugins.RELEASE.set()
    assert len(groups) == 2
    for g in groups:
        assert sorted(s.reward for s in g.samples) == [0.5, 1.0]  # never the failed one's 0
        check_group(g, 2)
        assert all("reward_failure" not in s.metadata for s in g.samples)
        assert g.metadata["reward_failures"] == 1
        (adv,) = compute_advantages([[s.reward for s in g.samples]], kind="grpo")
        assert sorted(adv.tolist()) == pytest.approx([-(0.5**0.5), 0.5**0.5], abs=1e-5)
    assert c["reward_failures"] == 2 and c["groups_dropped_reward_failures"] == 0
    logged = [r.getMessage() for r in caplog.records if "left out of its group" in r.getMessage()]
    assert logged and why in logged[0]


def test_a_group_needs_two_rewards_or_one_and_its_greedy_baseline():
    from asyncrl.rollout.group_maker import min_scored

    assert [min_scored(n) for n in (1, 2, 8)] == [1, 2, 2]  # a group of one: a critic's sample
    assert min_scored(8, baseline=True) == 1  # ReMax: r - b needs no second sample


def test_a_group_left_without_rewards_is_dropped_and_a_reward_that_always_fails_stops_it(
    engine, tokenizer, caplog
):
    """A reward that always raises: each group keeps no sample to train on, so it is dropped by name
    with its reason and its prompt counted as used (a reward failing on a row would fail again),
    and after ``max_consecutive_failures`` such groups the worker stops, saying why, instead of
    training on 0s or spinning."""

    async def run(svc):
        async with make_worker(
            engine,
            tokenizer,
            svc.address,
            reward="tests.rollout_plugins:raising_reward",
            max_concurrent_groups=1,
            max_consecutive_failures=3,
        ) as w:
            # the worker's nursery raises its one error (old code: trains on 0s, never stops)
            error = await run_to_failure(w)
        return str(error), w.stats.counters, w.source, svc.stats()

    with serve_buffer(groups_per_batch=2, max_staleness=0) as svc:
        error, c, source, stats = trio.run(run, svc)
    assert "3 groups failed in a row" in error and "3 of 3 rewards failed" in error
    assert "ValueError: this reward is broken on purpose" in error
    assert c["groups_dropped_reward_failures"] == 3 and c["reward_failures"] == 9
    assert c["groups_failed"] == 0 and c["groups_delivered"] == 0
    assert stats["stored_total"] == 0
    assert source.next_index == 3 and not source.outstanding and not source._retry
    dropped = [r.getMessage() for r in caplog.records if " dropped: " in r.getMessage()]
    assert len(dropped) == 3 and all("rewards failed" in m for m in dropped)


def test_groups_that_became_stale_are_cancelled_and_released(engine, tokenizer):
    """eta = 0: a version announced while a group generates makes it untrainable; the worker
    cancels it, gives its start back, and starts replacements under the new version."""

    async def go(svc):
        async with make_worker(
            engine, tokenizer, svc.address, svc.pub_address, max_new_tokens=400
        ) as w:
            async with trio.open_nursery() as n:
                n.start_soon(w.run)
                sched = engine.engine.scheduler
                old = (f"w0-{w._nonce}-1/", f"w0-{w._nonce}-2/")

                def old_requests():
                    live = list(sched.running) + list(sched.waiting)
                    return [r for r in live if r.rid.startswith(old)]

                await wait_for(lambda: len(old_requests()) >= 3, "episodes on the engine")
                # paused in place, the engine holds its requests where they are: none can end on
                # its own (EOS, length) before the worker reacts to the version, however loaded
                # the machine; aborts still run while paused
                await trio.to_thread.run_sync(engine.engine.call, lambda: sched.pause("in_place"))
                try:
                    reqs = [r for r in old_requests() if r.finish is None]
                    assert reqs and svc.stats()["granted"] == 2
                    await new_version(svc, engine, 1)
                    # their requests are aborted on the engine, not left to run to the end
                    await wait_for(lambda: all(r.finish for r in reqs), "old requests ended")
                    assert all(r.finish["type"] == "abort" for r in reqs)
                finally:  # the engine serves the module's other tests
                    await trio.to_thread.run_sync(engine.engine.call, sched.resume)
                # the buffer took the stale starts back and granted 2 replacements at version 1
                await wait_for(lambda: svc.stats()["granted"] == 4, "replaced")
                w.stop()
            return svc.stats()

    with serve_buffer(groups_per_batch=2, max_staleness=0) as svc:
        stats = trio.run(go, svc)
    assert stats["closed_stale"] == 2  # the stale starts came back, and
    assert stats["stored_total"] == 0 and stats["arrived"] == 0  # no stale group was delivered
    check_every_group_had_a_start(stats)


def test_multi_turn_groups_through_the_worker(engine, tokenizer):
    import copy

    chat = copy.deepcopy(tokenizer)  # a chat template that shows the tools' schemas
    chat.chat_template = (
        "{% for t in tools or [] %}tool {{ t['function']['name'] }}: "
        "{{ t['function']['description'] }}\n{% endfor %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "
    )

    async def go(svc):
        async with make_worker(
            engine,
            chat,
            svc.address,
            workflow=load_workflow("tests.rollout_plugins:tool_workflow"),
            reward="tests.rollout_plugins:length_reward",
            max_new_tokens=80,
            max_groups=2,
            chat_template=True,
        ) as w:
            await w.run()
        return await take_batch(svc), w.stats.counters

    with serve_buffer(groups_per_batch=2, max_staleness=0) as svc:
        groups, counters = trio.run(go, svc)
    assert len(groups) == 2
    assert counters["tool_calls"] == 2 * counters["episodes"] >= 2 * 2 * 3
    assert counters["tool_errors"] == 0
    for g in groups:
        check_group(g, 3)
        prompt = tokenizer.decode(g.samples[0].prompt_ids.tolist())
        assert prompt.startswith("tool char_code_sum: Sum of the character codes of ``text``.\n")
        assert prompt.endswith("\nassistant: ")
        for s in g.samples:
            assert len(s.metadata["tool_calls"]) == 2
            mask = s.loss_mask.astype(int)
            # tool output is masked, and it is exactly the chat template's tool turn
            masked = tokenizer.decode(s.completion_ids[mask == 0].tolist())
            assert masked.count("\ntool: ") == 2 and masked.endswith("\nassistant: ")
            assert [c["ok"] for c in s.metadata["tool_calls"]] == [True, True]
            assert (s.behavior_logprobs[mask == 0] == 0).all()
            assert np.isfinite(s.reward) and s.reward == len(s.completion_ids)


def test_worker_registers_again_after_a_learner_restart(engine, tokenizer, tmp_path):
    """The buffer service (the learner's rank 0) goes away and comes back on the same address:
    the worker notices the silence in version announcements, registers its generators with the new
    one, and keeps delivering."""
    from asyncrl.buffer.service import BufferService

    cfg = BufferConfig(
        address=f"ipc://{tmp_path}/buffer.ipc",
        pub_address=f"ipc://{tmp_path}/pub.ipc",
        groups_per_batch=2,
        max_staleness=0,
        lease_seconds=60,
    )
    registered: list[tuple[int, str]] = []

    def start(n: int) -> BufferService:
        svc = BufferService(cfg, announce_every_s=0.2)
        svc.on_register(lambda worker_id, gens: registered.append((n, worker_id)))
        return svc.start()

    async def go():
        svc = await trio.to_thread.run_sync(start, 1)
        async with make_worker(
            engine, tokenizer, cfg.address, cfg.pub_address, learner_silence_s=1.0
        ) as w:
            async with trio.open_nursery() as n:
                n.start_soon(w.run)
                # stored is not enough: the acknowledgement must have reached the worker too, or
                # it resends the group to the new service, which never granted its lease
                delivered = w.stats.counters
                await wait_for(
                    lambda: delivered["groups_delivered"] == 2, "acknowledged by the first"
                )
                await trio.to_thread.run_sync(svc.stop)
                await trio.sleep(1.5)  # a learner restart takes a while (> learner_silence_s)
                svc = await trio.to_thread.run_sync(start, 2)
                try:
                    await wait_for(lambda: (2, "w0") in registered, "registered again")
                    await wait_for(lambda: svc.stats()["stored_total"] == 2, "stored by the second")
                    w.stop()
                    stats = svc.stats()
                finally:
                    await trio.to_thread.run_sync(svc.stop)
        return stats

    stats = trio.run(go)
    assert registered[0] == (1, "w0") and (2, "w0") in registered
    check_every_group_had_a_start(stats)


def test_no_lease_is_taken_until_a_generator_holds_weights_within_the_bound(engine, tokenizer):
    """A worker joins a learner at version 5 (eta 1) with an engine holding the base weights: it
    labels the engine "0" and registers it, but asks for no lease while the engine is behind the
    bound; once the broadcaster's update says 5, it generates, and every token says 5."""

    async def go(svc):
        await trio.to_thread.run_sync(svc.set_version, 5)
        async with make_worker(
            engine, tokenizer, svc.address, svc.pub_address, max_staleness=1
        ) as w:
            async with trio.open_nursery() as n:
                n.start_soon(w.run)
                await wait_for(lambda: svc.stats()["workers_registered"] == 1, "registered")
                assert get_label(engine.url) == "0"  # labelled at join, before registering
                await wait_for(lambda: w.pool.min_version == 4, "the learner's version heard")
                t0 = w.stats.weights_wait_s
                await wait_for(lambda: w.stats.weights_wait_s > t0 + 0.5, "a visible wait")
                assert svc.stats()["acquires"] == 0 and svc.stats()["started"] == 0
                assert w.snapshot()["rollout/weights_wait_s"] > 0.5
                await trio.to_thread.run_sync(set_label, engine.url, "5")  # the broadcaster
                groups = await take_batch(svc)
                w.stop()
            return groups

    with serve_buffer(groups_per_batch=2, max_staleness=1) as svc:
        groups = trio.run(go, svc)
    for g in groups:
        check_group(g, 3)
        assert all((s.versions == 5).all() for s in g.samples)


def test_remax_groups_carry_the_greedy_completions_reward(engine, tokenizer):
    """With ``greedy_baseline`` each group plays one greedy episode too: its reward is the group's
    baseline, its tokens are counted apart and are in no sample. Checked against a greedy decode
    through the engine and the reward function, outside the worker."""
    reward = "tests.rollout_plugins:ids_reward"

    async def go(svc):
        async with make_worker(
            engine, tokenizer, svc.address, reward=reward, max_groups=2, greedy_baseline=True
        ) as w:
            await w.run()
            groups = await take_batch(svc)
            greedy = dataclasses.replace(w.groups.params, temperature=0.0)
            ref = [await w.pool.generate(g.samples[0].prompt_ids.tolist(), greedy) for g in groups]
        return groups, ref, dict(w.stats.counters)

    with serve_buffer(groups_per_batch=2, max_staleness=0) as svc:
        groups, ref, c = trio.run(go, svc)
    assert len(groups) == 2 and c["remax_baseline_failures"] == 0
    for g, r in zip(groups, ref, strict=True):
        check_group(g, 3)
        assert [s.id for s in g.samples] == [f"{g.id}/{i}" for i in range(3)]  # no greedy sample
        want = rollout_plugins.ids_reward("", "", [], r.output_ids)
        assert g.baseline_reward == pytest.approx(want)
        assert "remax_baseline_failure" not in g.metadata
    sampled = sum(int(s.loss_mask.sum()) for g in groups for s in g.samples)
    assert c["tokens_generated"] == sampled  # the greedy tokens are counted apart
    assert c["greedy_tokens_generated"] == sum(len(r.output_ids) for r in ref)


def test_a_failed_greedy_episode_leaves_the_group_without_a_baseline(engine, tokenizer):
    async def go(svc):
        async with make_worker(
            engine,
            tokenizer,
            svc.address,
            workflow=rollout_plugins.greedy_fails,
            max_groups=2,
            greedy_baseline=True,
        ) as w:
            await w.run()
        return await take_batch(svc), dict(w.stats.counters)

    with serve_buffer(groups_per_batch=2, max_staleness=0) as svc:
        groups, c = trio.run(go, svc)
    assert len(groups) == 2 and c["remax_baseline_failures"] == 2 and c["groups_failed"] == 0
    assert c["greedy_tokens_generated"] == 0
    for g in groups:
        check_group(g, 3)  # the sampled episodes stand
        assert g.baseline_reward is None
        assert "greedy episodes fail on purpose" in g.metadata["remax_baseline_failure"]


def test_a_worker_whose_generators_the_learner_dropped_stops_and_says_why(engine, tokenizer):
    """The learner at version 5 (eta 1), the worker's engine at 0: the worker waits for weights,
    and goes on waiting while the learner says nothing against its generator (a broadcast may be on
    its way). Once the learner's status says it sends that generator no weights (what its
    broadcaster reports: dropped, and why) for ``dropped_limit_s`` on end, the worker stops with
    the learner's reason, instead of waiting for ever."""
    from asyncrl.rollout.worker import WorkerError

    dropped: dict[str, str] = {}

    async def go(svc):
        svc.watch_generators(lambda: dict(dropped))
        await trio.to_thread.run_sync(svc.set_version, 5)
        async with make_worker(
            engine, tokenizer, svc.address, svc.pub_address, max_staleness=1, dropped_limit_s=0.5
        ) as w:
            with trio.fail_after(WAIT_S), pytest.raises(ExceptionGroup) as e:
                async with trio.open_nursery() as n:
                    n.start_soon(w.run)
                    await wait_for(lambda: w.pool.min_version == 4, "the learner's version heard")
                    t0 = w.stats.weights_wait_s
                    await wait_for(lambda: w.stats.weights_wait_s > t0 + 1.5, "a long wait")
                    dropped[engine.url] = "preflight: unreachable"  # the broadcaster's verdict
        (error,) = e.value.exceptions
        while isinstance(error, ExceptionGroup):
            (error,) = error.exceptions
        assert isinstance(error, WorkerError), error
        return str(error), svc.stats()

    with serve_buffer(groups_per_batch=2, max_staleness=1) as svc:
        error, stats = trio.run(go, svc)
    assert error.startswith("no generator within the staleness bound (learner at version 5, ")
    assert error.endswith(f"{engine.url}: preflight: unreachable")
    assert stats["acquires"] == 0
