"""Supervising `asyncrl run`'s children: start each in its own process group, restart the dead, stop
them all.

No orphans: a child gets SIGTERM when the launcher dies (PR_SET_PDEATHSIG), and every stop signals
the child's whole process group (torchrun's ranks, a worker's engines), then SIGKILLs what is left.
A child that dies is restarted up to ``run.max_restarts`` times, except on exit code 2 (a user's
mistake: the same command would fail the same way).
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.learner_info import read_learner_info
from asyncrl.recipe import Recipe
from asyncrl.stacks import dump_stacks_on_usr1

STOP_GRACE_S = 60.0
"""How long a child may take to exit after SIGTERM (the learner saves a checkpoint) before SIGKILL."""
KILL_WAIT_S = 10.0
"""How long the launcher waits for SIGKILLed process groups to be gone (the kernel reaps them; a
process in uninterruptible I/O can take a while)."""
LOG_TAIL_LINES = 30
USAGE_EXIT = 2
"""Every asyncrl command exits 2 on a user's mistake; restarting it would fail the same way."""


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """preexec_fn: SIGTERM this child when the launcher dies, even by SIGKILL (Linux only)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass(kw_only=True)
class Child:
    """One child process in its own process group, with its output in ``log``."""

    name: str
    argv: list[str]
    log: Path
    restart_args: list[str] = field(default_factory=list)  # added to argv when it is restarted
    finishes_run: bool = False  # the learner: its exit 0 is the run's end, not a death
    proc: subprocess.Popen | None = None
    stopping: bool = False
    restarts: int = 0

    def start(self, env: dict[str, str]) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # own process group: pgid == pid
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )

    def restart(self, env: dict[str, str], code: int) -> None:
        """Start again once nothing of the dead child's process group is left (a worker's engines
        hold ports and memory), marking the restart in its log."""
        self.signal_group(signal.SIGKILL)
        deadline = time.monotonic() + 30.0
        while _group_alive(self.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.restarts += 1
        with self.log.open("a") as out:
            out.write(f"\n--- asyncrl run: exited with code {code}; restart {self.restarts} ---\n")
        self.argv = [*self.argv, *self.restart_args]
        self.restart_args = []
        self.start(env)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def tail(self, n: int = LOG_TAIL_LINES) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_children(children: Sequence[Child], *, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every child's group, wait up to ``grace_s`` for all of them, SIGKILL the rest and
    wait (up to :data:`KILL_WAIT_S`) until their groups are empty too.

    Waits on the groups, not only the direct children: a worker's engines or torchrun's ranks must
    be gone too before the launcher returns.
    """
    started = [c for c in children if c.proc is not None]
    for c in started:
        c.stopping = True
        c.signal_group(signal.SIGTERM)
    if _wait_groups_gone(started, grace_s):
        return
    for c in started:
        c.signal_group(signal.SIGKILL)
    # A SIGKILLed grandchild (an engine, a torchrun rank) is still exiting when its parent, the
    # direct child, has been reaped: the launcher must not return (nor a caller find it) before.
    _wait_groups_gone(started, KILL_WAIT_S)


def _wait_groups_gone(started: Sequence[Child], timeout_s: float) -> bool:
    """Reap the direct children while waiting up to ``timeout_s`` for every child's process group
    to be empty; whether they all are."""
    deadline = time.monotonic() + timeout_s
    while True:
        for c in started:
            c.poll()  # reap the direct child so its group can empty
        if not any(_group_alive(c.pid) for c in started):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


CHILD_ENV = {  # one thread per process (two in one process run many times slower), offline hub
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
}


def child_env(r: Recipe) -> dict[str, str]:
    """The environment of every child: one thread each, offline hub, W&B mode from the recipe."""
    env = {**os.environ, **CHILD_ENV, "WANDB_SILENT": "true"}
    env.setdefault("WANDB_MODE", r.logging.wandb_mode if r.logging.wandb else "disabled")
    return env


def write_pids(children: Sequence[Child], run_dir: Path) -> None:
    """logs/pids.json: each child's pid, which is also its process group id (replaced whole: a
    reader never sees half of it)."""
    path = run_dir / "logs" / "pids.json"
    path.with_suffix(".tmp").write_text(json.dumps({c.name: c.pid for c in children}) + "\n")
    os.replace(path.with_suffix(".tmp"), path)


def restart_the_dead(
    children: Sequence[Child], max_restarts: int, env: dict[str, str], run_dir: Path
) -> Child | None:
    """Restart each child that died, if it may be restarted; the first that may not, or None.

    A worker that exited 0 is dead too, unless the learner has ended the run (learner.json says so:
    the worker heard the end and left while the learner writes its summary). The learner's exit 0
    is left to the caller (the run is complete)."""
    for c in children:
        code = c.poll()
        if code is None or (code == 0 and (c.finishes_run or _run_ended(run_dir))):
            continue
        if code in (0, USAGE_EXIT) or c.restarts >= max_restarts:
            return c
        print(
            f"asyncrl run: {c.name} exited with code {code}; restarting it "
            f"({c.restarts + 1} of run.max_restarts={max_restarts}); its log: {c.log}",
            file=sys.stderr,
        )
        c.restart(env, code)
        write_pids(children, run_dir)
    return None


def _run_ended(run_dir: Path) -> bool:
    info = read_learner_info(run_dir)
    return info is not None and info.ended_at is not None


class _Stop(Exception):
    """SIGINT or SIGTERM reached the launcher."""


def _raise_stop(signum, frame):  # pragma: no cover - signal handler
    raise _Stop(signal.Signals(signum).name)


def dump_stacks_and_pass_on(children: Sequence[Child]) -> Callable[[int, object], None]:
    """The launcher's SIGUSR1 handler: its own stacks to its stderr, then the signal to every
    child's process group (each in a group of its own, so a signal to the launcher's group does
    not reach them; asyncrl's processes dump their stacks on it, :mod:`asyncrl.stacks`)."""

    def handler(signum: int, frame: object) -> None:  # pragma: no cover - signal handler
        faulthandler.dump_traceback(all_threads=True)
        for c in children:
            c.signal_group(signal.SIGUSR1)

    return handler


def supervise(
    children: Sequence[Child],
    *,
    env: dict[str, str],
    run_dir: Path,
    max_restarts: int,
    deadline: float,
    grace_s: float = STOP_GRACE_S,
    tick: Callable[[], None] = lambda: None,
    before_stop: Callable[[], None] = lambda: None,
) -> tuple[str, Child | None]:
    """Start the children (those not started yet), keep them alive until the run ends, then stop
    them all.

    Returns the outcome ("completed": the first child, the learner, exited 0; "failed"; "timeout"
    at ``deadline`` (monotonic); "stopped (SIGINT)" or SIGTERM) and the child that died for good.
    ``tick`` runs every 0.1 s (the progress display); an error it raises stops the run and
    propagates. ``before_stop`` runs before the children are stopped.
    """
    old = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    old[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, dump_stacks_and_pass_on(children))
    failed: Child | None = None
    try:
        for child in children:
            if child.proc is None:  # the reward model's servers are started (and healthy) already
                child.start(env)
        write_pids(children, run_dir)
        while True:
            if children[0].poll() == 0:
                outcome = "completed"
                break
            failed = restart_the_dead(children, max_restarts, env, run_dir)
            if failed is not None:
                outcome = "failed"
                break
            if time.monotonic() > deadline:
                outcome = "timeout"
                break
            tick()
            time.sleep(0.1)
    except _Stop as e:
        outcome = f"stopped ({e})"
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not orphan children
        before_stop()
        stop_children(children, grace_s=grace_s)
        for s, h in old.items():
            if h is None:  # not a Python handler: faulthandler's (asyncrl.stacks)
                dump_stacks_on_usr1()
            else:
                signal.signal(s, h)
    return outcome, failed
