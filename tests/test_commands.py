"""`asyncrl learner` and `asyncrl rollout` as two separate processes, as on a cluster (README
"Running the processes yourself"): no `asyncrl run` in between.

The learner binds port 0; the worker is started with the exact `asyncrl rollout` line the learner
printed (the same line is in the run folder's learner.json). The run completes, the learner's end
announcement makes the worker leave with exit 0, and the learner leaves the summary and plots that
`asyncrl run` would. The same over tls+tcp:// with certificates made here.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trustme

from asyncrl.launch import CHILD_ENV
from tests.test_e2e import SUMMARY_KEYS, _paths, _pgroup_alive

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

STEPS, ETA = 4, 2
WORKER_EXIT_S = 15.0  # the acceptance bound: the worker leaves this soon after the learner's end


def _tls_overrides(d: Path) -> list[str]:
    """One certificate for both sides (the learner's server and the worker's client), for the
    address the worker dials (127.0.0.1), signed by a CA made here."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    d.mkdir()
    (d / "ca.pem").write_bytes(ca.cert_pem.bytes())
    (d / "node.pem").write_bytes(b"".join(p.bytes() for p in cert.cert_chain_pems))
    (d / "node.key").write_bytes(cert.private_key_pem.bytes())
    return [
        "buffer.address=tls+tcp://127.0.0.1:0",
        "buffer.pub_address=tls+tcp://127.0.0.1:0",
        f"buffer.tls.cert={d / 'node.pem'}",
        f"buffer.tls.key={d / 'node.key'}",
        f"buffer.tls.ca={d / 'ca.pem'}",
    ]


def _printed_command(text: str) -> str | None:
    """The line after "start a rollout worker with:" in the learner's output; None until the
    learner has printed it whole (it writes learner.json first, then prints the lines)."""
    lines = text.splitlines(keepends=True)
    try:
        i = lines.index("start a rollout worker with:\n")
    except ValueError:
        return None
    if i + 1 == len(lines) or not lines[i + 1].endswith("\n"):
        return None
    return lines[i + 1].strip()


@pytest.mark.parametrize(
    "transport",
    [
        "tcp",
        # ~30-50 s more on 2 cores: in `make test-faults`; the tcp variant runs by default
        pytest.param("tls", marks=pytest.mark.faults),
    ],
)
def test_learner_and_rollout_as_separate_commands(tmp_path, demo_dir, transport):
    out = tmp_path / "runs"
    ov = [
        *_paths(demo_dir),
        f"run.output_dir={out}",
        f"run.steps={STEPS}",
        "run.eval_prompts=16",
        "rollout.group_size=4",
        "rollout.max_concurrent_groups=8",
        "buffer.groups_per_batch=2",
        f"buffer.max_staleness={ETA}",
        "buffer.dynamic_sampling=false",  # the untrained model's rewards are often all equal
        "learner.checkpoint_every=0",
        "generator.max_batch_size=16",
        *(_tls_overrides(tmp_path / "tls") if transport == "tls" else []),
    ]
    run_dir = out / "demo"
    env = {**os.environ, **CHILD_ENV, "WANDB_MODE": "disabled"}
    learner_log, worker_log = tmp_path / "learner.log", tmp_path / "worker.log"
    asyncrl = [sys.executable, "-m", "asyncrl.cli"]
    procs: list[subprocess.Popen] = []

    def start(argv: list[str], log: Path) -> subprocess.Popen:
        with log.open("wb") as f:
            p = subprocess.Popen(
                argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        procs.append(p)
        return p

    def tails() -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text()[-3000:]}"
            for p in (learner_log, worker_log)
            if p.exists()
        )

    def wait(cond, timeout_s: float, what: str) -> float:
        """Poll until ``cond()``; the Unix time it became true."""
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s\n{tails()}"
            time.sleep(0.05)
        return time.time()

    try:
        learner = start([*asyncrl, "learner", str(ROOT / "recipes/demo.yaml"), *ov], learner_log)
        # the printed line, not learner.json: the learner writes the file, then prints
        wait(
            lambda: (
                _printed_command(learner_log.read_text()) is not None or learner.poll() is not None
            ),
            180,
            "the printed rollout command",
        )
        assert learner.poll() is None, tails()
        info = json.loads((run_dir / "learner.json").read_text())
        printed = _printed_command(learner_log.read_text())
        assert printed == info["rollout_command"]
        scheme = "tls+tcp" if transport == "tls" else "tcp"
        for key in ("buffer_address", "pub_address"):  # port 0 resolved, and in the printed line
            host, port = info[key].rsplit(":", 1)
            assert host == f"{scheme}://127.0.0.1" and int(port) > 0 and info[key] in printed
        argv = shlex.split(printed)
        assert argv[:2] == ["asyncrl", "rollout"]
        worker = start([*asyncrl, *argv[1:], "--worker-id", "worker0"], worker_log)

        exits: dict[str, float] = {}  # Unix time each process was seen gone (polled together)

        def gone() -> bool:
            for name, p in (("learner", learner), ("worker", worker)):
                if name not in exits and p.poll() is not None:
                    exits[name] = time.time()
            return "learner" in exits and ("worker" in exits or worker.returncode is None)

        wait(gone, 400, "the learner's end")
        assert learner.returncode == 0, tails()
        wait(
            lambda: gone() and "worker" in exits, WORKER_EXIT_S, "the worker to leave after the end"
        )
        learner_exit, worker_exit = exits["learner"], exits["worker"]
        assert worker.returncode == 0, tails()
        ended_at = json.loads((run_dir / "learner.json").read_text())["ended_at"]
        assert ended_at is not None
        print(
            f"TIMING {transport}: worker exit {worker_exit - ended_at:+.1f} s after the end "
            f"announcement, {worker_exit - learner_exit:+.1f} s after the learner's exit"
        )
        assert worker_exit - ended_at < WORKER_EXIT_S

        # the learner: its progress, its summary (the same fields as `asyncrl run`'s), its plots
        text = learner_log.read_text()
        progress = [x for x in text.splitlines() if x.startswith("asyncrl learner: version ")]
        assert progress and all("workers" in x for x in progress), text[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert set(summary) == SUMMARY_KEYS
        assert summary["outcome"] == "completed" and summary["steps"] == STEPS
        assert summary["max_staleness_seen"] is not None and summary["max_staleness_seen"] <= ETA
        assert 0.0 <= summary["reward_start"] <= 1.0 and 0.0 <= summary["reward_end"] <= 1.0
        (headline,) = [json.loads(x) for x in text.splitlines() if x.startswith('{"outcome"')]
        assert headline == {k: summary[k] for k in headline}  # printed: the summary's headline
        for plot in ("reward.png", "staleness.png", "throughput.png", "learning.png"):
            assert (run_dir / "plots" / plot).is_file(), plot
        assert (run_dir / "hf/latest/config.json").is_file()

        # the worker: it heard the end, said so, and printed its own summary
        wtext = worker_log.read_text()
        assert "the learner ended the run at version" in wtext
        assert any(x.startswith("asyncrl rollout: version ") for x in wtext.splitlines())
        (mine,) = [json.loads(x) for x in wtext.splitlines() if x.startswith('{"worker_id"')]
        assert mine["outcome"] == "run_ended" and mine["version"] == STEPS
        assert mine["groups_delivered"] >= STEPS * 2
        assert not _pgroup_alive(worker.pid)  # its engine left with it
    finally:
        for p in procs:
            if _pgroup_alive(p.pid):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
