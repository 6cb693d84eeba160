"""`asyncrl run RECIPE [key=value ...]`: the whole system on one machine (docs/design.md §1).

Starts the learner (alone, or under torchrun when ``learner.ranks > 1``), ``rollout.workers``
rollout workers (each starts its built-in engines) and, with ``rollout.reward_model.path`` or
``rollout.teacher.path``, the reward model's /classify servers and the distillation teacher's
/generate servers (``model_servers``: healthy before the others start) as child
processes, each in its own process group with one thread, waits until the learner's buffer answers,
shows progress, and stops everything when the learner finishes, on Ctrl-C / SIGTERM, or when a child dies for good (printing its log's tail).
A child that dies is first restarted, up to ``run.max_restarts`` times: a rollout worker with the same
command (it resumes its data position from the buffer), the learner with ``run.resume=true`` (from its
last checkpoint; the workers reconnect by themselves). Exit code 2 (a user's mistake: a bad recipe,
plugin or data file) is never restarted: the same command would fail the same way. The run folder
``runs/<name>/`` gets ``metrics.jsonl``, ``wandb/``, checkpoints, ``logs/*.log`` and, from the
learner at its end (:func:`asyncrl.summary.finish_run`, done here only if the learner could not),
the held-out evaluation, ``plots/*.png`` and ``summary.json``, to which the launcher adds its restarts.

No orphans: a child gets SIGTERM when the launcher dies (PR_SET_PDEATHSIG), and every stop signals the
child's whole process group (torchrun's ranks, a worker's engines), then SIGKILLs what is left.

The parts: ``plan`` (the run folder; which processes, with which arguments), ``model_servers``
(the reward model's and the teacher's servers and their urls), ``children``
(supervising them: start, restart the dead, stop), ``watch`` (the progress display) and
``amend_summary`` (summary.json at the end: the learner's, amended with what only the launcher knows).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl import recipe as recipe_mod
from asyncrl import summary as summary_mod
from asyncrl.launch.amend_summary import write_run_summary
from asyncrl.launch.children import CHILD_ENV, STOP_GRACE_S, USAGE_EXIT, child_env, supervise
from asyncrl.launch.model_servers import (
    check_reward_model,
    reward_model_summary,
    server_children,
    start_servers,
    url_overrides,
)
from asyncrl.launch.plan import LaunchError, make_plan, prepare_run_dir
from asyncrl.launch.watch import RunWatch

# CHILD_ENV: the environment test harnesses give the processes they start, as the launcher does
__all__ = ["CHILD_ENV", "LaunchError", "main", "run"]


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
    check_reward_model(r)
    run_dir = prepare_run_dir(r, overwrite=overwrite)
    (run_dir / "recipe.yaml").write_text(recipe_mod.dump(r))
    t0, started_at = time.monotonic(), time.time()
    sock_dir = Path(tempfile.mkdtemp(prefix="asyncrl-"))  # short path: ipc socket names are <108 B
    env = child_env(r)
    try:
        # the reward model's and the teacher's servers first: healthy before anything asks them
        model_servers = server_children(r, run_dir, sock_dir)
        urls = start_servers(model_servers, env, timeout_s=r.generator.startup_timeout_s)
    except BaseException:
        shutil.rmtree(sock_dir, ignore_errors=True)
        raise
    plan = make_plan(r, recipe_path, [*overrides, *url_overrides(model_servers, urls)], sock_dir)
    plan.children.extend(model_servers)  # after the learner: children[0] ends the run
    enabled = r.logging.progress if progress is None else progress
    watch = RunWatch(r, plan.buffer_address, run_dir, t0=t0, enabled=enabled)
    try:
        outcome, failed = supervise(
            plan.children,
            env=env,
            run_dir=run_dir,
            max_restarts=r.run.max_restarts,
            deadline=t0 + r.run.timeout_s,
            grace_s=stop_grace_s,
            tick=watch.tick,
            before_stop=watch.close,
        )
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
    if failed is not None:
        print(
            f"asyncrl run: {failed.name} exited with code {failed.poll()}; "
            f"last lines of {failed.log}:\n{failed.tail()}",
            file=sys.stderr,
        )
    summary = write_run_summary(
        r,
        run_dir,
        outcome=outcome,
        t0=t0,
        started_at=started_at,
        status=watch.status,
        children=plan.children,
    )
    if (
        r.rollout.reward_model.path and model_servers
    ):  # the learner saw only urls: the model, its accuracy and plot, here
        summary["reward_model"] = rm = reward_model_summary(r, run_dir)
        if rm.get("plot"):
            summary.setdefault("plots", []).append(rm["plot"])
        summary_mod.write_summary(run_dir, summary)
    return summary


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="asyncrl run", description=__doc__.splitlines()[0])
    p.add_argument("recipe", help="YAML recipe file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. run.steps=10")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--stop-grace-s",
        type=float,
        default=STOP_GRACE_S,
        metavar="S",
        help=f"how long the children may take to exit after SIGTERM, before SIGKILL (the learner "
        f"saves a checkpoint; default {STOP_GRACE_S:g}): a caller with a deadline of its own sets "
        "run.timeout_s + this below it",
    )
    a = p.parse_intermixed_args(argv)
    if a.stop_grace_s < 0:
        print("asyncrl run: --stop-grace-s must be >= 0", file=sys.stderr)
        return USAGE_EXIT
    try:
        summary = run(
            a.recipe,
            a.overrides,
            overwrite=a.overwrite,
            progress=False if a.no_progress else None,
            stop_grace_s=a.stop_grace_s,
        )
    except (recipe_mod.RecipeError, LaunchError) as e:
        print(f"asyncrl run: {e}", file=sys.stderr)
        return USAGE_EXIT
    print(summary_mod.summary_line(summary))
    return 0 if summary["outcome"] == "completed" else 1
