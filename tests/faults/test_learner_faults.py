"""Faults on the learner's side: `asyncrl learner` (buffer service + weight broadcaster + TorchTitan
trainer) killed with SIGKILL and started again with the same command, while a real rollout worker
with its own built-in engine keeps running and reconnects by itself."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

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

from asyncrl.buffer.client import REQUEST_TIMEOUT_S

pytestmark = pytest.mark.faults

ETA = 1
STEPS = 10
CKPT_EVERY = 3


@pytest.mark.timeout(600)  # its waits are bounded below; the loaded machine needs more than 300 s
def test_learner_killed_restarts_from_its_checkpoint_and_loses_nothing(tmp_path: Path, tiny_qwen3):
    t_start = time.monotonic()
    data = write_prompts(tmp_path / "train.jsonl", 200)
    sock = tmp_path / "sock"
    sock.mkdir()
    recipe = write_recipe(
        tmp_path,
        tiny_qwen3,
        data,
        run={"steps": STEPS, "resume": True},
        buffer={
            "address": f"ipc://{sock}/buffer.ipc",  # the same address after a restart
            "pub_address": f"ipc://{sock}/pub.ipc",
            "max_staleness": ETA,
            "batch_timeout_s": 120,
            "lease_seconds": 20,
        },
        learner={"lr": 1e-4, "checkpoint_every": CKPT_EVERY, "checkpoint_async": False},
        weights={"timeout_s": 30, "backend": "gloo"},
    )
    run_dir = tmp_path / "runs" / "faults"
    audit_file = run_dir / "buffer" / "trained.jsonl"
    learner_argv = [sys.executable, "-m", "asyncrl.cli", "learner", str(recipe)]
    learner = Proc("learner", learner_argv, tmp_path / "learner.log").start()
    worker = Proc(
        "worker0",
        rollout_argv(recipe, "worker0", f"ipc://{sock}/buffer.ipc", f"ipc://{sock}/pub.ipc"),
        tmp_path / "worker0.log",
    ).start()
    procs = [learner, worker]

    def versions() -> list[int]:
        return [r["version"] for r in read_jsonl(audit_file) if "groups" in r]

    try:
        wait_until(
            lambda: max(versions(), default=0) >= CKPT_EVERY + 2,
            timeout_s=300,
            what=f"the learner past version {CKPT_EVERY + 2}",
            procs=procs,
        )
        learner.kill9()
        t_dead = time.monotonic()
        log_at_death = len(worker.log.read_text())
        v_dead = max(versions())
        # Complete checkpoints only: a kill during a save leaves a step folder without DCP's
        # .metadata, which resuming must skip (it resumes from the one before).
        folders = sorted((run_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))
        ckpts = [int(p.name[5:]) for p in folders if (p / ".metadata").is_file()]
        assert ckpts and ckpts[-1] <= v_dead
        # The same command again.
        t_restart = time.monotonic()
        n_records = len(read_jsonl(audit_file))
        learner = Proc("learner-2", learner_argv, tmp_path / "learner-2.log").start()
        procs = [learner, worker]
        wait_until(
            lambda: any("groups" in r for r in read_jsonl(audit_file)[n_records:]),
            timeout_s=300,
            what="the restarted learner's first step",
            procs=procs,
        )
        t_recover = time.monotonic() - t_restart
        t_down = time.monotonic() - t_dead
        # while the learner was gone the worker kept retrying, and said so once a minute; or,
        # its generator behind the bound (the dead learner never sent the weights it announced),
        # it waited for weights without asking the buffer, and said that
        wlog = worker.log.read_text()
        retries = {k: wlog.count(f"{k}: no reply") for k in ("acquire", "register")}
        retries["put"] = wlog.count("group(s): no reply")
        # (a wait that began before the kill and had not ended at it counts: it says so once)
        before = wlog[:log_at_death]
        waiting_at_death = before.rfind("waiting for the learner's weights") > before.rfind(
            "the learner's weights arrived"
        )
        waited = waiting_at_death or "waiting for the learner's weights" in wlog[log_at_death:]
        # (a learner back before any request could time out leaves nothing to retry: nng resends
        # the pending request to the restarted learner, which answers it)
        quick = t_down < REQUEST_TIMEOUT_S
        assert sum(retries.values()) >= 1 or waited or quick, (t_down, wlog[-3000:])
        assert max(retries.values()) <= 2 + t_down / 60, (retries, t_down)
        wait_until(
            lambda: (
                (run_dir / "learner.json").exists()
                and json.loads((run_dir / "learner.json").read_text())["ended_at"]
            ),
            timeout_s=400,
            what=f"the restarted learner to reach version {STEPS}",
            procs=[learner],
        )
        # it reconnected by itself (no restart needed) and leaves at the end the learner announces
        ended_at = json.loads((run_dir / "learner.json").read_text())["ended_at"]
        wait_until(lambda: not worker.alive(), timeout_s=15, what="the worker to leave at the end")
        worker_exit_s = time.time() - ended_at
        assert worker.proc.returncode == 0, worker.tail()
        assert "the learner ended the run at version" in worker.log.read_text()
        wait_until(
            lambda: learner.proc.poll() is not None, timeout_s=120, what="the learner's exit"
        )
        assert learner.proc.returncode == 0, learner.tail()

        audit = read_jsonl(audit_file)
        steps, starts, stored, dropped = lineage(audit)
        restart = [r for r in audit if "start" in r][-1]
        assert starts[-1] == ckpts[-1], (starts, ckpts)  # resumed at the saved version
        assert [s["version"] for s in steps] == list(range(1, STEPS + 1))
        trained = [g["id"] for s in steps for g in s["groups"]]
        acked = acked_ids(run_dir / "audit")
        lost = set(acked) - set(trained) - set(stored) - set(dropped)
        duplicated = len(trained) - len(set(trained))
        staleness = [s["trained_at"] - g["min_version"] for s in steps for g in s["groups"]]
        after_restart = [g["id"] for s in steps if s["version"] > starts[-1] for g in s["groups"]]
        assert not lost and duplicated == 0, (sorted(lost)[:5], duplicated)
        assert max(staleness) <= ETA, staleness
        assert after_restart, "nothing trained after the restart"
        readmitted = {k: v for k, v in restart.get("readmitted", {}).items() if k != "dropped_ids"}
        elapsed = time.monotonic() - t_start
        assert elapsed < 600
        report(
            {
                "scenario": "kill -9 the learner, same command again",
                "killed_at_version": v_dead,
                "resumed_at_version": starts[-1],
                "recover_s": round(t_recover, 1),
                "worker_warnings_while_down": retries,
                "worker_exit_after_end_s": round(worker_exit_s, 1),
                "readmitted_from_journal": readmitted,
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
