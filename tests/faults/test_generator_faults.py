"""Faults on a generator: one of two generator servers (built-in engines serving SGLang's API,
driven by URL as SGLang servers are) killed with SIGKILL while it is generating, under the real
learner (`asyncrl learner`: buffer service + weight broadcaster). Its episodes go to the other one,
the broadcaster drops it and goes on, and a server started again on the same address rejoins at the
learner's current weights, found by the worker and the broadcaster by themselves.

(A worker's own built-in engine that dies ends that worker, by design: tests/rollout/test_main.py.)

(SIGKILL in the middle of a weight update is tests/weights/test_broadcast.py's faults test.)
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
from harness import (
    Proc,
    acked_ids,
    lineage,
    read_jsonl,
    report,
    rollout_argv,
    wait_until,
    write_prompts,
    write_recipe,
)

pytestmark = pytest.mark.faults

ETA = 1
STEPS = 10_000  # far more than needed: the test stops the learner (SIGTERM) once it has seen enough


@pytest.mark.timeout(600)  # its waits are bounded below; the loaded machine needs more than 300 s
def test_generator_killed_mid_generation_is_dropped_and_rejoins(tmp_path: Path, tiny_qwen3):
    import trio

    from asyncrl.engine import start_engine_process
    from asyncrl.generator_http import WeightsClient, async_client
    from asyncrl.wire import GeneratorInfo

    t_start = time.monotonic()
    engines = [
        start_engine_process(
            tiny_qwen3, seed=i, log_path=tmp_path / f"engine{i}.log", timeout_s=120
        )
        for i in range(2)
    ]
    data = write_prompts(tmp_path / "train.jsonl", 400)
    sock = tmp_path / "sock"
    sock.mkdir()
    buffer, pub = f"ipc://{sock}/buffer.ipc", f"ipc://{sock}/pub.ipc"
    recipe = write_recipe(
        tmp_path,
        tiny_qwen3,
        data,
        run={"steps": STEPS},
        rollout={"max_concurrent_groups": 4, "request_timeout_s": 60},
        generator={"kind": "sglang", "urls": [e.url for e in engines]},
        buffer={
            "address": buffer,
            "pub_address": pub,
            "max_staleness": ETA,
            "batch_timeout_s": 120,
        },
        learner={"lr": 1e-4, "checkpoint_every": 0, "export_every": 2},
        weights={"timeout_s": 20, "backend": "gloo"},
    )
    run_dir = tmp_path / "runs" / "faults"
    audit_file = run_dir / "buffer" / "trained.jsonl"
    learner = Proc(
        "learner",
        [sys.executable, "-m", "asyncrl.cli", "learner", str(recipe)],
        tmp_path / "learner.log",
    ).start()
    worker = Proc(
        "worker0", rollout_argv(recipe, "worker0", buffer, pub), tmp_path / "worker0.log"
    ).start()
    procs = [learner, worker]
    revived = None

    def version() -> int:
        return max((r["version"] for r in read_jsonl(audit_file) if "groups" in r), default=0)

    try:
        wait_until(lambda: version() >= 3, timeout_s=300, what="version 3", procs=procs)
        url, port = engines[0].url, engines[0].port
        engines[0].proc.send_signal(signal.SIGKILL)
        engines[0].proc.wait(30)
        t_kill = time.monotonic()
        v_kill = version()
        wait_until(
            lambda: version() >= v_kill + 3,
            timeout_s=240,
            what="training to go on with one engine",
            procs=procs,
        )
        t_recover = time.monotonic() - t_kill
        wait_until(
            lambda: "dropped generator" in learner.log.read_text(),
            timeout_s=120,
            what="the broadcaster to drop the dead engine",
            procs=procs,
        )

        # An engine started again on the same address: the worker's pool and the broadcaster
        # find it by themselves; it loads the latest export and joins at the next version.
        def served() -> int:  # tokens the revived engine generated: only the worker asks it
            return httpx.get(url + "/engine_stats", timeout=10).json()["generated_tokens"]

        revived = start_engine_process(
            tiny_qwen3, port=port, log_path=tmp_path / "revived.log", timeout_s=120
        )
        t_revive = time.monotonic()

        async def weight_version() -> str | None:  # what the broadcaster's preflight asks
            async with async_client(10) as http:
                return await WeightsClient(GeneratorInfo(url=url), http).weight_version()

        def caught_up() -> bool:
            v = trio.run(weight_version)
            return v is not None and v.isdigit() and int(v) >= version() - 1 and int(v) > v_kill

        wait_until(
            caught_up, timeout_s=180, what="the revived engine at the current version", procs=procs
        )
        t_rejoin = time.monotonic() - t_revive
        wait_until(
            lambda: served() > 0,
            timeout_s=120,
            what="the worker to use the revived engine",
            procs=procs,
        )
        v_revived = version()
        wait_until(
            lambda: version() >= v_revived + 3, timeout_s=120, what="3 more versions", procs=procs
        )
        assert learner.stop(timeout_s=120) == 0, learner.tail()  # SIGTERM: a clean stop
        assert worker.stop() == 0, worker.tail()

        steps, _, stored, dropped = lineage(read_jsonl(audit_file))
        assert [s["version"] for s in steps] == list(range(1, len(steps) + 1))
        trained = [g["id"] for s in steps for g in s["groups"]]
        acked = acked_ids(run_dir / "audit")
        lost = set(acked) - set(trained) - set(stored) - set(dropped)
        duplicated = len(trained) - len(set(trained))
        staleness = [s["trained_at"] - g["min_version"] for s in steps for g in s["groups"]]
        assert not lost and duplicated == 0, (sorted(lost)[:5], duplicated)
        assert max(staleness) <= ETA
        last = [
            m
            for m in read_jsonl(run_dir / "metrics.jsonl")
            if m.get("process") == "worker0" and "rollout/groups_failed" in m
        ]
        assert last[-1]["rollout/groups_failed"] == 0  # its episodes went to the other engine
        elapsed = time.monotonic() - t_start
        assert elapsed < 600
        report(
            {
                "scenario": "kill -9 a generator mid-generation, start it again",
                "killed_at_version": v_kill,
                "recover_s": round(t_recover, 1),
                "rejoin_s": round(t_rejoin, 1),
                "groups_failed": last[-1]["rollout/groups_failed"],
                "acked": len(set(acked)),
                "dropped_named": len(dropped),
                "lost": len(lost),
                "duplicated": duplicated,
                "staleness_max": max(staleness),
                "seconds": round(elapsed, 1),
            }
        )
    finally:
        for p in (worker, learner):
            p.stop(timeout_s=20)
        for e in [*engines, revived]:
            if e is not None:
                e.stop()
