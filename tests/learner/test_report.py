"""What `asyncrl learner` tells its user and its workers (asyncrl.learner.report), with the real
buffer service on loopback and a stand-in for the trainer (only its version and run folder are read)."""

from __future__ import annotations

import json
import shlex
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from asyncrl import learner_info, recipe
from asyncrl.buffer.service import BufferService
from asyncrl.learner import report

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Trainer:
    run_dir: Path
    version: int = 0


@pytest.fixture
def learner(tmp_path):
    overrides = [f"run.output_dir={tmp_path}", "buffer.address=tcp://0.0.0.0:0", "run.resume=true"]
    r = recipe.load(ROOT / "recipes/demo.yaml", overrides, check_files=False)
    svc = BufferService(r.buffer, announce_every_s=0.2).start()
    inv = report.Invocation(recipe_path=str(ROOT / "recipes/demo.yaml"), overrides=overrides)
    rep = report.LearnerReport(r, Trainer(run_dir=r.run_dir), source=svc, invocation=inv)
    yield rep, svc
    rep.close()
    svc.stop()


def test_announce_prints_and_writes_the_real_addresses_and_the_joining_command(learner, capsys):
    rep, svc = learner
    rep.announce()
    err = capsys.readouterr().err
    info = learner_info.read_learner_info(rep.trainer.run_dir)
    assert info is not None and info.ended_at is None
    host = socket.gethostname()  # bound on every interface: dialled by this host's name
    assert info.buffer_address == f"tcp://{host}:{svc.address.rsplit(':', 1)[1]}"
    assert info.pub_address == svc.pub_address  # the recipe's 127.0.0.1, port resolved
    assert not info.pub_address.endswith(":0")
    argv = shlex.split(info.rollout_command)
    assert argv[:3] == ["asyncrl", "rollout", str(ROOT / "recipes/demo.yaml")]
    assert argv[argv.index("--buffer") + 1] == info.buffer_address
    assert argv[argv.index("--pub") + 1] == info.pub_address
    # the learner's other overrides are repeated; its own addresses and run.resume are not
    assert f"run.output_dir={rep.trainer.run_dir.parent}" in argv
    assert not [a for a in argv if a.startswith(("buffer.address=", "run.resume="))]
    assert info.buffer_address in err and info.rollout_command in err
    assert "start a rollout worker with:" in err


def test_a_learner_without_workers_says_how_to_start_one(learner, capsys):
    rep, _ = learner
    rep.announce()
    rep.waiting_since = 0.0  # waiting for a batch, since long ago
    rep.refresh()
    assert "no rollout worker has registered" not in capsys.readouterr().err  # just started
    rep._t0 -= report.NO_WORKER_HINT_S  # a minute later, still nobody
    rep.refresh()
    rep.refresh()  # said once a minute, not every second
    err = capsys.readouterr().err
    assert err.count("no rollout worker has registered for 60 s; start one with:") == 1
    assert rep.info.rollout_command in err


def test_end_tells_the_service_and_learner_json(learner):
    rep, svc = learner
    rep.announce()
    rep.trainer.version = 7
    rep.end()
    assert svc.stats()["ended"]
    info = json.loads((rep.trainer.run_dir / "learner.json").read_text())
    assert info["version"] == 7 and info["ended_at"] >= info["started_at"]


def test_the_progress_display_is_a_task_of_the_control_plane(learner):
    """``start(plane)`` runs the refresh as a named task of rank 0's control plane: it picks up what
    the learner appends to metrics.jsonl; ``close`` ends the task and leaves the plane running."""
    from asyncrl.control import ControlPlane
    from tests.faults.harness import wait_until

    rep, _ = learner
    plane = ControlPlane("test-control")
    try:
        rep.start(plane)
        run_dir = rep.trainer.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"process": "learner", "step": 3, "loss": 0.5}) + "\n")
        wait_until(lambda: rep.tail.learner_step == 3, timeout_s=10, what="a refresh by the task")
        rep.close()
        assert rep._progress_done is not None and rep._progress_done.is_set()
        assert plane.alive and plane.failure is None
    finally:
        plane.close()


def test_linger_ends_once_every_lease_is_given_back(learner):
    """After the end the service answers the workers' releases; `asyncrl run` waited the whole
    END_LINGER_S even when the worker had given everything back at once."""
    import threading

    import trio

    from asyncrl.buffer.client import BufferClient

    rep, svc = learner
    rep.announce()

    async def call(fn):
        async with BufferClient(svc.address, worker_id="w") as c:
            return await fn(c)

    grant = trio.run(call, lambda c: c.acquire(2))
    assert grant.starts == 2
    rep.end()
    lingering = threading.Thread(target=rep.linger)
    lingering.start()
    lingering.join(timeout=0.5)
    assert lingering.is_alive()  # a live lease: the service keeps answering
    trio.run(call, lambda c: c.release(grant.lease_id, grant.starts))
    lingering.join(timeout=report.END_LINGER_S)
    assert not lingering.is_alive()
    assert time.time() < rep.info.ended_at + report.END_LINGER_S  # before the deadline
