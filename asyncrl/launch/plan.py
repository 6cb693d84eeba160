"""Which processes `asyncrl run` starts, with which arguments, and the run folder they share."""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.launch.children import Child
from asyncrl.learner_info import LEARNER_FILE
from asyncrl.recipe import Recipe


class LaunchError(RuntimeError):
    """The run could not start or did not finish; the message is one line for the user."""


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
    (run_dir / LEARNER_FILE).unlink(missing_ok=True)  # a finished run's, if resumed
    return run_dir


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
    workers = r.rollout.workers if r.algorithm.uses_rollouts else 0
    for i in range(workers):
        argv = [py, "-m", "asyncrl.cli", "rollout", str(recipe_path), "--buffer", buffer]
        argv += ["--pub", pub, "--worker-id", f"worker{i}", *common]
        plan.children.append(Child(name=f"rollout{i}", argv=argv, log=logs / f"rollout{i}.log"))
    return plan
