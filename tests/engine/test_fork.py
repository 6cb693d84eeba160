"""A rollout worker's engines on the CPU are forked from the worker (asyncrl/engine/process.py).

Each case runs in a fresh interpreter of one thread, as the worker is when it starts its engines
(pytest's own process has threads of its own, and a fork from it is refused): it starts an engine
with ``fork=True``, asks it for greedy tokens, stops it, and prints what it saw as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import atexit, json, os, sys, threading
    import httpx
    from asyncrl.engine.process import spawn_engine_process

    model, log, thread = sys.argv[1], sys.argv[2], sys.argv[3] == "thread"
    # an exit handler of this process's own: it must run at this process's exit, never the child's
    atexit.register(lambda: open(log + ".exits", "a").write(f"{os.getpid()}\\n"))
    if thread:  # a thread that runs on while the engine starts: no fork from here
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
    ep = spawn_engine_process(model, device="cpu", log_path=log, fork=True)
    try:
        ep.wait_healthy(120)
        cmdline = open(f"/proc/{ep.pid}/cmdline", "rb").read().split(b"\\0")
        body = {
            "input_ids": [9, 10, 11],
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        }
        ids = httpx.post(ep.url + "/generate", json=body, timeout=60).json()["output_ids"]
        seen = {
            "forked": type(ep.proc).__name__ == "ForkedChild",
            "fresh_interpreter": b"asyncrl.engine.server" in cmdline,
            "ids": ids,
        }
    finally:
        seen_code = ep.stop()
    print(json.dumps({**seen, "code": seen_code, "alive": ep.alive(), "pid": os.getpid()}))
    """
)


def _start(model: Path, tmp_path: Path, *, thread: bool = False, fork_env: str | None = None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("ASYNCRL_ENGINE_FORK", None)
    if fork_env is not None:
        env["ASYNCRL_ENGINE_FORK"] = fork_env
    log = tmp_path / "engine.log"
    args = [str(model), str(log), "thread" if thread else "-"]
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, env=env, timeout=240
    )
    return p, log


@pytest.fixture(scope="module")
def spawned(tiny_qwen3, tmp_path_factory) -> dict:
    """The same engine started as a fresh interpreter (ASYNCRL_ENGINE_FORK=0)."""
    p, log = _start(tiny_qwen3, tmp_path_factory.mktemp("spawned"), fork_env="0")
    assert p.returncode == 0, p.stderr + log.read_text()
    return json.loads(p.stdout.splitlines()[-1])


def test_a_forked_engine_serves_what_a_fresh_one_does_and_stops(tiny_qwen3, tmp_path, spawned):
    p, log = _start(tiny_qwen3, tmp_path)
    assert p.returncode == 0, p.stderr + log.read_text()
    forked = json.loads(p.stdout.splitlines()[-1])
    assert forked["forked"] and not forked["fresh_interpreter"]
    assert not spawned["forked"] and spawned["fresh_interpreter"]
    assert forked["ids"] == spawned["ids"] and len(forked["ids"]) == 6
    assert forked["code"] == 0 and not forked["alive"]  # SIGTERM: a clean stop, reaped
    assert "serving" in log.read_text()  # its output went to its own log
    # the caller's exit handler ran once, at the caller's exit; the child ran none of the caller's
    assert log.with_name("engine.log.exits").read_text().split() == [str(forked["pid"])]


def test_no_fork_from_a_process_with_another_thread(tiny_qwen3, tmp_path, spawned):
    p, log = _start(tiny_qwen3, tmp_path, thread=True)
    assert p.returncode == 0, p.stderr + log.read_text()
    seen = json.loads(p.stdout.splitlines()[-1])
    assert not seen["forked"] and seen["fresh_interpreter"]
    assert seen["ids"] == spawned["ids"]


def test_a_forked_engine_that_cannot_start_says_why(tmp_path):
    """A folder without config.json: the forked child exits 2 with the engine's one-line error,
    and waiting for it raises with that line (as for a fresh interpreter)."""
    code = textwrap.dedent(
        """
        import sys
        from asyncrl.engine.process import spawn_engine_process

        ep = spawn_engine_process(sys.argv[1], device="cpu", log_path=sys.argv[2], fork=True)
        assert type(ep.proc).__name__ == "ForkedChild"
        try:
            ep.wait_healthy(60)
        except RuntimeError as e:
            print(e)
        print("code", ep.proc.returncode)
        """
    )
    (tmp_path / "model").mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("ASYNCRL_ENGINE_FORK", None)
    p = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "model"), str(tmp_path / "e.log")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert "engine exited with code 2" in p.stdout
    assert "not a HuggingFace model folder" in p.stdout
    assert "code 2" in p.stdout and "Traceback" not in p.stdout
