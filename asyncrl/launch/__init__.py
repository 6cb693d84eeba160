"""`asyncrl run RECIPE [key=value ...]`: the whole system on one machine (docs/design.md §1).

Starts the learner (alone, or under torchrun when ``learner.ranks > 1``) and ``rollout.workers``
rollout workers (each starts its built-in engines) as child processes, each in its own process group
with one thread, waits until the learner's buffer answers, shows progress, and stops everything when
the learner finishes, on Ctrl-C / SIGTERM, or when a child dies for good (printing its log's tail).
A child that dies is first restarted, up to ``run.max_restarts`` times: a rollout worker with the same
command (it resumes its data position from the buffer), the learner with ``run.resume=true`` (from its
last checkpoint; the workers reconnect by themselves). Exit code 2 (a user's mistake: a bad recipe,
plugin or data file) is never restarted: the same command would fail the same way. The run folder
``runs/<name>/`` gets ``metrics.jsonl``, ``wandb/``, checkpoints, ``logs/*.log`` and, from the
learner at its end (:func:`asyncrl.summary.finish_run`, done here only if the learner could not),
the held-out evaluation, ``plots/*.png`` and ``summary.json``, to which the launcher adds its restarts.

No orphans: a child gets SIGTERM when the launcher dies (PR_SET_PDEATHSIG), and every stop signals the
child's whole process group (torchrun's ranks, a worker's engines), then SIGKILLs what is left.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl import progress as progress_mod
from asyncrl import recipe as recipe_mod
from asyncrl import summary as summary_mod
from asyncrl.recipe import Recipe

STOP_GRACE_S = 60.0
"""How long a child may take to exit after SIGTERM (the learner saves a checkpoint) before SIGKILL."""
LOG_TAIL_LINES = 30
USAGE_EXIT = 2
"""Every asyncrl command exits 2 on a user's mistake; restarting it would fail the same way."""


class LaunchError(RuntimeError):
    """The run could not start or did not finish; the message is one line for the user."""


# --------------------------------------------------------------------------------------------------
# Child processes
# --------------------------------------------------------------------------------------------------


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
    """SIGTERM every child's group, wait up to ``grace_s`` for all of them, SIGKILL the rest.

    Waits on the groups, not only the direct children: a worker's engines or torchrun's ranks must
    be gone too before the launcher returns.
    """
    started = [c for c in children if c.proc is not None]
    for c in started:
        c.stopping = True
        c.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        for c in started:
            c.poll()  # reap the direct child so its group can empty
        if not any(_group_alive(c.pid) for c in started):
            return
        time.sleep(0.05)
    for c in started:
        c.signal_group(signal.SIGKILL)
    for c in started:
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.proc.wait(timeout=5)  # type: ignore[union-attr]


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


# --------------------------------------------------------------------------------------------------
# The plan: which processes, with which arguments
# --------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class Plan:
    recipe_path: Path
    overrides: list[str]
    run_dir: Path
    buffer_address: str
    pub_address: str
    children: list[Child] = field(default_factory=list)


def _local_address(address: str, sock_dir: Path, name: str) -> str:
    """A recipe address with port 0 becomes an ipc:// socket (no port race); others are kept."""
    if address.startswith("tcp://") and address.rsplit(":", 1)[-1] == "0":
        return f"ipc://{sock_dir / name}"
    return address


def make_plan(r: Recipe, recipe_path: Path, overrides: list[str], sock_dir: Path) -> Plan:
    """The learner and the rollout workers of one machine, as argv lists (nothing started)."""
    buffer = _local_address(r.buffer.address, sock_dir, "buffer.ipc")
    pub = _local_address(r.buffer.pub_address, sock_dir, "pub.ipc")
    common = [*overrides, f"buffer.address={buffer}", f"buffer.pub_address={pub}"]
    run_dir = r.run_dir.resolve()
    common.append(f"run.output_dir={run_dir.parent}")
    logs = run_dir / "logs"
    py = sys.executable
    if r.learner.ranks > 1:
        learner_argv = [
            py,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={r.learner.ranks}",
            "-m",
            "asyncrl.cli",
            "learner",
            str(recipe_path),
            *common,
        ]
    else:
        learner_argv = [py, "-m", "asyncrl.cli", "learner", str(recipe_path), *common]
    plan = Plan(
        recipe_path=recipe_path,
        overrides=overrides,
        run_dir=run_dir,
        buffer_address=buffer,
        pub_address=pub,
    )
    plan.children.append(
        Child(
            name="learner",
            argv=learner_argv,
            log=logs / "learner.log",
            finishes_run=True,
            restart_args=[] if r.run.resume else ["run.resume=true"],  # from its last checkpoint
        )
    )
    workers = r.rollout.workers if r.algorithm.loss != "sft" else 0
    for i in range(workers):
        argv = [py, "-m", "asyncrl.cli", "rollout", str(recipe_path), "--buffer", buffer]
        argv += ["--pub", pub, "--worker-id", f"worker{i}", *common]
        plan.children.append(Child(name=f"rollout{i}", argv=argv, log=logs / f"rollout{i}.log"))
    return plan


# --------------------------------------------------------------------------------------------------
# Watching the run: the buffer's status (the metrics file: asyncrl.progress)
# --------------------------------------------------------------------------------------------------


def buffer_status(address: str, r: Recipe, timeout_s: float = 2.0) -> dict[str, Any] | None:
    """The buffer's Status reply as a dict (version + stats), or None if it does not answer."""
    from asyncrl import transport, wire

    tls = transport.TLS.from_config(r) if r.buffer.tls.cert else None
    try:
        with transport.ReqClient(address, tls=tls, timeout_s=timeout_s) as client:
            reply = client.request_sync(wire.Status(), timeout_s=timeout_s)
    except (transport.TransportTimeout, wire.WireError, OSError):
        return None
    except Exception:  # pynng errors while the learner starts or stops
        return None
    if isinstance(reply, wire.StatusReply):
        return {"version": reply.version, **reply.stats}
    return None


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------


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
    info = summary_mod.read_learner_info(run_dir)
    return info is not None and info.ended_at is not None


class _Stop(Exception):
    """SIGINT or SIGTERM reached the launcher."""


def _raise_stop(signum, frame):  # pragma: no cover - signal handler
    raise _Stop(signal.Signals(signum).name)


def prepare_run_dir(r: Recipe, *, overwrite: bool) -> Path:
    run_dir = r.run_dir.resolve()
    if run_dir.exists() and any(run_dir.iterdir()) and not r.run.resume:
        if not overwrite:
            raise LaunchError(
                f"run folder {run_dir} exists: pass run.resume=true to continue it, "
                "--overwrite to start over, or run.name=NEW"
            )
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / summary_mod.LEARNER_FILE).unlink(missing_ok=True)  # a finished run's, if resumed
    return run_dir


def run(
    recipe_path: str | Path,
    overrides: Sequence[str] = (),
    *,
    overwrite: bool = False,
    progress: bool | None = None,
    stop_grace_s: float = STOP_GRACE_S,
) -> dict[str, Any]:
    """Run a recipe to completion on this machine; returns the summary (also in summary.json)."""
    recipe_path = Path(recipe_path).resolve()
    overrides = list(overrides)
    r = recipe_mod.load(recipe_path, overrides)
    run_dir = prepare_run_dir(r, overwrite=overwrite)
    (run_dir / "recipe.yaml").write_text(recipe_mod.dump(r))
    t0, started_at = time.monotonic(), time.time()
    status: dict[str, Any] | None = None
    outcome = "running"
    sock_dir = Path(tempfile.mkdtemp(prefix="asyncrl-"))  # short path: ipc socket names are <108 B
    plan = make_plan(r, recipe_path, overrides, sock_dir)
    env = child_env(r)
    display = progress_mod.Display(
        r.run.steps, enabled=r.logging.progress if progress is None else progress
    )
    tail = progress_mod.MetricsTail(run_dir / "metrics.jsonl")
    old = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    failed: Child | None = None
    try:
        for child in plan.children:
            child.start(env)
        write_pids(plan.children, run_dir)
        deadline = t0 + r.run.timeout_s
        healthy = False
        uses_buffer = r.algorithm.loss != "sft"
        last_poll = 0.0
        while True:
            if plan.children[0].poll() == 0:
                outcome = "completed"
                break
            failed = restart_the_dead(plan.children, r.run.max_restarts, env, run_dir)
            if failed is not None:
                outcome = "failed"
                break
            if time.monotonic() > deadline:
                outcome = "timeout"
                break
            now = time.monotonic()
            if now - last_poll >= 1.0:
                last_poll = now
                st = buffer_status(plan.buffer_address, r, timeout_s=1.0) if uses_buffer else None
                if st is not None:
                    status, healthy = st, True
                elif uses_buffer and not healthy and now - t0 > r.generator.startup_timeout_s:
                    raise LaunchError(
                        f"the learner's buffer at {plan.buffer_address} did not answer within "
                        f"{r.generator.startup_timeout_s:g} s (generator.startup_timeout_s)"
                    )
                tail.update()
                version = int(status.get("version", 0)) if status else tail.learner_step
                info = progress_mod.progress_info(tail, r.buffer.max_staleness, sft=not uses_buffer)
                display.update(version, info)
            time.sleep(0.1)
    except _Stop as e:
        outcome = f"stopped ({e})"
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not orphan children
        display.close()
        stop_children(plan.children, grace_s=stop_grace_s)
        for s, h in old.items():
            signal.signal(s, h)
        shutil.rmtree(sock_dir, ignore_errors=True)
    if failed is not None:
        print(
            f"asyncrl run: {failed.name} exited with code {failed.poll()}; "
            f"last lines of {failed.log}:\n{failed.tail()}",
            file=sys.stderr,
        )
    wall = time.monotonic() - t0
    info = summary_mod.read_learner_info(run_dir)
    if info is not None and info.ended_at is not None and info.ended_at >= started_at:
        wall = info.ended_at - started_at  # to the end of training, not of the learner's evaluation
    restarts = {c.name: c.restarts for c in plan.children if c.restarts}
    summary = summary_mod.read_summary(run_dir, since=started_at)  # the learner's, at its end
    if summary is None:  # the learner could not write it (killed, or failed): the same end, here
        return summary_mod.finish_run(
            r,
            run_dir=run_dir,
            outcome=outcome,
            wall_seconds=wall,
            status=status,
            restarts=restarts,
        )
    # the learner's exit 0 is "completed" here; its summary knows whether it was stopped instead
    summary_mod.amend(
        summary,
        wall_seconds=wall,
        restarts=restarts,
        outcome=summary["outcome"] if outcome == "completed" else outcome,
    )
    summary_mod.write_summary(run_dir, summary)
    return summary


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="asyncrl run", description=__doc__.splitlines()[0])
    p.add_argument("recipe", help="YAML recipe file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. run.steps=10")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = p.parse_intermixed_args(argv)
    try:
        summary = run(
            a.recipe, a.overrides, overwrite=a.overwrite, progress=False if a.no_progress else None
        )
    except (recipe_mod.RecipeError, LaunchError) as e:
        print(f"asyncrl run: {e}", file=sys.stderr)
        return USAGE_EXIT
    print(summary_mod.summary_line(summary))
    return 0 if summary["outcome"] == "completed" else 1
