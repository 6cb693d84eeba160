"""Shared parts of the faults tier: real child processes, bounded waits, audits of group ids.

Every wait here polls a condition against a deadline and fails with the children's log tails when
the deadline passes; nothing sleeps a fixed time and hopes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from asyncrl.launch import CHILD_ENV

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
FAULTS = Path(__file__).resolve().parent


def child_env(**extra: str) -> dict[str, str]:
    """One thread per child, no hub, no W&B; tests/ and tests/faults/ importable (user plug-ins)."""
    path = [str(FAULTS), str(TESTS), os.environ.get("PYTHONPATH", "")]
    return {
        **os.environ,
        **CHILD_ENV,
        "WANDB_MODE": "disabled",
        "PYTHONPATH": os.pathsep.join(p for p in path if p),
        **extra,
    }


@dataclass
class Proc:
    """A child process in its own process group, its output in ``log``."""

    name: str
    argv: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=child_env)
    proc: subprocess.Popen | None = None

    def start(self) -> Proc:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        """SIGKILL this process only (not its children): the fault under test."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        assert self.proc is not None
        self.proc.wait(timeout=30)

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL the whole group; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)  # whatever the child left behind
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        return self.proc.returncode

    def tail(self, n: int = 40) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return f"--- {self.name} ({self.log}) ---\n" + "\n".join(lines[-n:])


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                text = Path(f"/proc/{pid}/task/{task}/children").read_text()
                out += [int(x) for x in text.split()]
    return out


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(
    pred: Callable[[], Any], *, timeout_s: float, what: str, procs: Iterable[Proc] = ()
) -> Any:
    """Poll ``pred`` until truthy; fail with ``what`` and the log tails after ``timeout_s``."""
    procs = list(procs)
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        dead = [p for p in procs if p.proc is not None and p.proc.poll() not in (None, -9)]
        if dead or time.monotonic() > deadline:
            why = "exited" if dead else f"not within {timeout_s:g} s"
            tails = "\n".join(p.tail() for p in procs)
            raise AssertionError(f"waiting for {what}: {why}\n{tails}")
        time.sleep(0.1)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a JSONL file another process appends to (a torn last line is skipped)."""
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def acked_ids(audit_dir: Path) -> list[str]:
    """Every group id the buffer acknowledged to a worker (the workers' ``*.acked.jsonl``)."""
    ids: list[str] = []
    for f in sorted(audit_dir.glob("*.acked.jsonl")):
        for rec in read_jsonl(f):
            ids += rec["acked"]
    return ids


def write_recipe(tmp: Path, model: Path, data: Path, **sections: dict[str, Any]) -> Path:
    """A small RL recipe for the tiny model; ``sections`` update the defaults section by section."""
    r: dict[str, Any] = {
        "run": {"name": "faults", "output_dir": str(tmp / "runs"), "seed": 0},
        "model": {"path": str(model), "max_seq_len": 128},
        "data": {"path": str(data), "shuffle": False},
        "rollout": {
            "group_size": 2,
            "max_concurrent_groups": 2,
            "max_new_tokens": 8,
            "reward": "exact_match",
            "reward_timeout_s": 5.0,
        },
        "generator": {"kind": "builtin", "engines_per_worker": 1, "startup_timeout_s": 120},
        "buffer": {"groups_per_batch": 2, "max_staleness": 1, "lease_seconds": 30},
        "logging": {"wandb": False},
    }
    for k, v in sections.items():
        r.setdefault(k, {}).update(v)
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(r))
    return path


def write_prompts(path: Path, n: int, *, extra: Iterable[str] = ()) -> Path:
    rows = [
        json.dumps({"prompt": f"{i % 10}+{i % 7}=", "answer": str(i % 10 + i % 7)})
        for i in range(n)
    ]
    path.write_text("\n".join([*rows, *extra]) + "\n")
    return path


def rollout_argv(recipe: Path, worker_id: str, buffer: str, pub: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "asyncrl.cli",
        "rollout",
        str(recipe),
        "--buffer",
        buffer,
        "--pub",
        pub,
        "--worker-id",
        worker_id,
        *extra,
    ]


def exactly_once(
    acked: list[str], trained: list[str], stored: list[str], dropped: Iterable[str] = ()
) -> dict[str, int]:
    """The audit: every acknowledged group trained, still stored, or dropped by name with a reason
    (stale, equal rewards: counted waste); none trained twice."""
    dropped = set(dropped)
    seen_twice = len(trained) - len(set(trained))
    lost = set(acked) - set(trained) - set(stored) - dropped
    return {
        "acked": len(set(acked)),
        "dropped_named": len(dropped & set(acked)),
        "lost": len(lost),
        "duplicated": seen_twice,
    }


def report(record: dict[str, Any]) -> None:
    """Print a scenario's figures (``pytest -s``) and, if ASYNCRL_FAULTS_RECORD names a file,
    append them there as a JSON line (RELIABILITY.md's table is made from these)."""
    line = json.dumps(record)
    print("FAULTS " + line)
    path = os.environ.get("ASYNCRL_FAULTS_RECORD")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def lineage(audit: list[dict]) -> tuple[list[dict], list[int], list[str], dict[str, str]]:
    """The steps of the run that survived, in order: a start at version r discards the steps after r
    (they were lost with the killed process). Returns (steps, versions resumed from, stored ids at
    the last stop, acknowledged groups dropped by name: id -> reason)."""
    steps: list[dict] = []
    starts: list[int] = []
    stored: list[str] = []
    drops: list[dict] = []
    for rec in audit:
        if "start" in rec:
            starts.append(rec["start"])
            steps = [s for s in steps if s["version"] <= rec["start"]]
            drops = [d for d in drops if d["at"] <= rec["start"]]
            named = rec.get("readmitted", {}).get("dropped_ids", {})
            if named:
                drops.append({"dropped": named, "at": rec["start"]})
        elif "stop" in rec:
            stored = rec["stored"]
        elif "dropped" in rec:
            drops.append(rec)
        elif "version" in rec:
            steps.append(rec)
    dropped = {gid: why for d in drops for gid, why in d["dropped"].items()}
    return steps, starts, stored, dropped
