"""`asyncrl learner RECIPE [key=value ...]`: the training loop, alone or under torchrun.

Reads like a table of contents: parse the recipe, build the source (rank 0) and the trainer, say
where it listens, loop pull → step → export → announce → checkpoint → log, announce the end, and in
``finally`` clean up and (at a clean end) write the run's summary and plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch.distributed as dist

from asyncrl import recipe as recipe_mod
from asyncrl.control import ControlPlane
from asyncrl.learner import source as source_mod
from asyncrl.learner.report import Invocation, LearnerReport
from asyncrl.learner.source import Batch, BatchSource, Signal, SourceError
from asyncrl.recipe import Recipe

if TYPE_CHECKING:
    from asyncrl.learner.eval_schedule import Evaluator
    from asyncrl.learner.trainer import Trainer
    from asyncrl.metrics import MetricsSink
    from asyncrl.weights.broadcaster import WeightBroadcaster

SourceFactory = Callable[[Recipe, Any, ControlPlane], BatchSource]
"""``factory(recipe, trainer, plane)`` -> rank 0's batch source, with ``trainer.source_state``
restored; a service runs as a task of ``plane``, rank 0's control plane."""


def sft_source(recipe: Recipe, trainer: Any, plane: ControlPlane) -> BatchSource:
    from asyncrl.learner.dataset_sources import SFTSource

    src = SFTSource.from_recipe(recipe)
    if trainer.source_state is not None:
        src.load_state_dict(trainer.source_state)
    return src


def preference_source(recipe: Recipe, trainer: Any, plane: ControlPlane) -> BatchSource:
    from asyncrl.learner.dataset_sources import PreferenceSource

    src = PreferenceSource.from_recipe(recipe)
    if trainer.source_state is not None:
        src.load_state_dict(trainer.source_state)
    return src


OFFLINE_SOURCES: dict[str, SourceFactory] = {
    "sft": sft_source,
    "reward_model": preference_source,
}
"""Rank 0's batch source of each loss trained from a local data set (no rollouts)."""


def buffer_source(recipe: Recipe, trainer: Any, plane: ControlPlane) -> BatchSource:
    """The replay buffer's nng service (rank 0), resumed from the checkpoint's buffer state."""
    from asyncrl.buffer.service import BufferService
    from asyncrl.reach import REACH_TIMEOUT_S, unreachable

    svc = BufferService(
        recipe.buffer,
        state=trainer.source_state,
        journal_dir=trainer.run_dir / "buffer",  # acked groups survive a kill between checkpoints
        journal_resume=recipe.run.resume,
        # a worker's first Register: refused if the broadcaster could never reach a generator
        reach=functools.partial(
            unreachable, timeout_s=min(REACH_TIMEOUT_S, recipe.weights.timeout_s)
        ),
    ).start(plane)
    svc.set_version(trainer.version)
    return svc


def _stop_on_signals() -> threading.Event:
    """SIGTERM / SIGINT ask for a clean stop: finish the step, checkpoint, export, exit 0.

    Returns the stop request the signals set. Rank 0 decides (its decision travels with the next
    batch broadcast), so all ranks stop together."""
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: stop.set())
    return stop


def match_sglang_nccl(recipe: Recipe) -> dict[str, str]:
    """Before the first NCCL communicator: the NCCL settings SGLang's servers run with, and the
    bound of the nonblocking weight group's calls (``weights.timeout_s``), unless set by hand
    (asyncrl.gpu). Process-wide, as NCCL and torch read them once; returns what it set."""
    import torch

    from asyncrl.gpu import recipe_needs_gloo, trainer_nccl_env, uses_nccl

    cuda = torch.cuda.is_available()
    g = recipe.generator
    nccl = uses_nccl(
        recipe.weights.backend,
        cuda=cuda,
        gloo_member=recipe_needs_gloo(g.kind, g.device, cuda=cuda),
    )
    env = trainer_nccl_env(os.environ, uses_nccl=nccl, weights_timeout_s=recipe.weights.timeout_s)
    os.environ.update(env)
    return env


def refuse_ipc_allocator(recipe: Recipe, environ: Mapping[str, str]) -> None:
    """``weights.backend: ipc`` on a GPU with allocator settings under which torch cannot pass
    rank 0's memory by handle: refused before the model is built (every update would fail at the
    engine, which would stay on version 0 and hold the learner at the staleness bound). Unsetting
    it here would change the memory behaviour asked for; ``auto`` is the doctor's to warn about
    (whether it takes handles depends on where the engines run)."""
    if recipe.weights.backend != "ipc":
        return
    import torch

    from asyncrl.weights.ipc import alloc_conf_problem

    problem = alloc_conf_problem(environ) if torch.cuda.is_available() else None
    if problem:
        raise recipe_mod.RecipeError(problem, key="weights.backend")


@dataclasses.dataclass
class _Services:
    """What the loop talks to besides the trainer, each None where this rank or run has none; set
    as each starts, so that ``finally`` closes what did."""

    plane: ControlPlane | None = None  # rank 0's: the buffer service's and the broadcaster's tasks
    report: LearnerReport | None = None  # rank 0's messages and progress display
    sink: MetricsSink | None = None  # rank 0's metrics records
    evaluator: Evaluator | None = None  # rank 0's held-out evaluation (RL, with held-out prompts)
    broadcaster: WeightBroadcaster | None = None  # every rank's, in an RL run


def train(
    recipe: Recipe,
    *,
    source_factory: SourceFactory | None = None,
    publishers: Sequence[Callable] = (),
    invocation: Invocation | None = None,
) -> int:
    """Run the learner to ``run.steps`` versions. Collective: every rank calls it.

    Rank 0 also tells its user where it listens and how it is doing (:class:`LearnerReport`), and
    at a clean end (the last version, or a stop on SIGTERM) writes the run's summary and plots
    (:func:`asyncrl.summary.finish_run`); at the last version it first announces the end."""
    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.distributed import ensure_distributed
    from asyncrl.learner.trainer import Trainer

    t0 = time.monotonic()
    refuse_ipc_allocator(recipe, os.environ)
    match_sglang_nccl(recipe)
    config = TrainerConfig.from_recipe(recipe)  # what the Trainer reads of the recipe
    rank, _ = ensure_distributed(config.collective_timeout_s)
    trainer = Trainer(config)
    if rank == 0:
        for warning in recipe_mod.warnings(recipe):  # the same lines `asyncrl check` prints
            print(f"asyncrl learner: warning: {warning}", file=sys.stderr, flush=True)
    if rank == 0 and trainer.version > 0:
        print(f"asyncrl learner: resumed at version {trainer.version}", file=sys.stderr, flush=True)
    if source_factory is None:
        rl = recipe.algorithm.uses_rollouts
        source_factory = buffer_source if rl else OFFLINE_SOURCES[recipe.algorithm.loss]
    svc = _Services()
    outcome = ""  # set at a clean end: "completed", or "stopped" (SIGTERM before the last version)
    try:
        _start_services(svc, recipe, trainer, rank, source_factory, invocation)
        saved_at = _train_steps(svc, recipe, trainer, rank, publishers)
        outcome = _save_the_end(recipe, trainer, rank, saved_at)
        _announce_the_end(svc, recipe, trainer, outcome)
        return 0
    finally:
        if svc.report is not None:
            svc.report.close()
        if svc.broadcaster is not None:
            svc.broadcaster.close()
        if svc.evaluator is not None and svc.evaluator.metrics is not None:
            svc.evaluator.metrics.close()
        trainer.close()
        if rank == 0 and outcome:  # while the buffer still answers the workers' last releases
            _finish(recipe, trainer, outcome=outcome, wall_seconds=time.monotonic() - t0)
            if svc.report is not None:
                svc.report.linger()
        if trainer.source is not None:
            trainer.source.stop()
        if svc.plane is not None:
            svc.plane.close()
        if svc.sink is not None:
            svc.sink.close()


def _start_services(
    svc: _Services,
    recipe: Recipe,
    trainer: Trainer,
    rank: int,
    source_factory: SourceFactory,
    invocation: Invocation | None,
) -> None:
    """Rank 0's batch source, its report (which announces where it listens), metrics sink and
    held-out evaluator; in an RL run every rank's weight broadcaster, which hears from the source
    of every generator that registers."""
    from asyncrl.metrics import MetricsSink

    rl = recipe.algorithm.uses_rollouts
    if rank == 0:
        svc.plane = ControlPlane("learner-control")
        trainer.source = source_factory(recipe, trainer, svc.plane)
        # the report shows the buffer service's addresses and counters: an RL run's source
        svc.report = LearnerReport(
            recipe, trainer, source=trainer.source if rl else None, invocation=invocation
        )
        svc.report.announce()
        svc.report.start(svc.plane)
        # after the announcement: W&B's start-up (~1 s) overlaps the workers' first groups
        svc.sink = MetricsSink.from_recipe(recipe, process="learner")
    if rl and rank == 0:  # held-out prompts, on the generators while they hold a version
        svc.evaluator = _evaluator(recipe, svc.report)
    if rl:  # weights to the generators after every step (every rank joins the gather)
        from asyncrl.weights.broadcaster import WeightBroadcaster

        evaluator = svc.evaluator
        svc.broadcaster = WeightBroadcaster(
            recipe.weights,
            export_dir=trainer.run_dir / "hf",
            after_sync=evaluator.after_sync if evaluator is not None else None,
            plane=svc.plane,
            lora=recipe.learner.lora,
        )
        if rank == 0:
            trainer.source.on_register(svc.broadcaster.on_register)
            trainer.source.watch_generators(svc.broadcaster.dropped)


def _train_steps(
    svc: _Services,
    recipe: Recipe,
    trainer: Trainer,
    rank: int,
    publishers: Sequence[Callable],
) -> int:
    """Step until ``run.steps`` versions or a clean stop: pull → step → weights out → export →
    announce → checkpoint → log. Returns the version last checkpointed (-1: none)."""
    broadcaster, evaluator = svc.broadcaster, svc.evaluator
    saved_at = -1
    first_batch = True
    stop = _stop_on_signals()
    while trainer.version < recipe.run.steps:
        batch = _wait_for_batch(svc, recipe, trainer, rank, stop)
        if batch is Signal.STOP:  # SIGTERM on rank 0: checkpoint and leave, on every rank
            break
        if evaluator is not None and first_batch:
            # the generators that made the first batch hold the weights the learner starts
            # from, unless a version went out already (then after_sync evaluated it)
            urls = [u for u, st in broadcaster.generators().items() if st != "dropped"]
            broadcaster.between_versions(
                functools.partial(evaluator.evaluate, trainer.version, urls)
            )
        first_batch = False
        result = trainer.step(batch)
        # the new version out (every rank joins the gather), then the caller's publishers
        if broadcaster is not None:
            broadcaster.on_step(trainer.version, trainer)
        for fn in publishers:
            fn(trainer.version, trainer)
        exported = trainer.maybe_export()
        if rank == 0:  # the step's drift sets the pipeline's depth before the version moves on
            trainer.source.adapt_depth(result.metrics)
            trainer.source.set_version(trainer.version, exported)
        if trainer.save_checkpoint():
            saved_at = trainer.version
        if broadcaster is not None and trainer.version >= recipe.run.steps:
            broadcaster.wait()  # the last version's sync metrics go in the last record
        if svc.sink is not None and trainer.version % recipe.logging.every == 0:
            weights = broadcaster.take_metrics() if broadcaster is not None else {}
            svc.sink.log(result.metrics | weights, step=trainer.version)
    return saved_at


def _wait_for_batch(
    svc: _Services, recipe: Recipe, trainer: Trainer, rank: int, stop: threading.Event
) -> Batch | Literal[Signal.STOP]:
    """The next batch, the same on every rank, or a clean stop. One wait, bounded by
    ``buffer.batch_timeout_s``, across the weights published during it: a generator that joins
    while the learner waits gets them first, as its data may be what the wait needs."""
    broadcaster, report = svc.broadcaster, svc.report
    waiting_since = time.monotonic()
    while True:
        if report is not None:
            report.waiting_since = waiting_since
        batch = source_mod.broadcast_batch(
            trainer.source,
            timeout_s=recipe.buffer.batch_timeout_s,
            waited_s=time.monotonic() - waiting_since,
            wants_publish=broadcaster.needs_sync if broadcaster and rank == 0 else None,
            settling=broadcaster.settling if broadcaster and rank == 0 else None,
            stop=stop,
        )
        if report is not None:
            report.waiting_since = None
        if batch is not Signal.PUBLISH:
            return batch
        broadcaster.on_step(trainer.version, trainer, force=True)


def _save_the_end(recipe: Recipe, trainer: Trainer, rank: int, saved_at: int) -> str:
    """The last version checkpointed and exported, and announced with its export; returns the
    outcome: "completed" at ``run.steps`` versions, else "stopped"."""
    if saved_at != trainer.version and trainer.version > 0:
        trainer.save_checkpoint(force=True)
    final = trainer.run_dir / "hf" / f"v{trainer.version}"
    if trainer.last_export != str(final.resolve()):
        trainer.export_hf(final)
    if rank == 0:
        trainer.source.set_version(trainer.version, str(final.resolve()))
    return "completed" if trainer.version >= recipe.run.steps else "stopped"


def _announce_the_end(svc: _Services, recipe: Recipe, trainer: Trainer, outcome: str) -> None:
    """At the last version: that version on the generators (and evaluated there), then the end
    told to the workers (rank 0's report). A stopped run may be resumed: its workers are not told
    to end."""
    if outcome != "completed":
        return
    if svc.broadcaster is not None:
        # before the workers end; on_step is a collective: every rank decides alike, from the
        # version alone
        if trainer.version % recipe.weights.every:
            svc.broadcaster.on_step(trainer.version, trainer, force=True)
        svc.broadcaster.wait()
    if svc.report is not None:
        svc.report.end()


def _evaluator(recipe: Recipe, report: LearnerReport | None) -> Any:
    """Rank 0's held-out evaluator (None without held-out prompts); its scores go to the metrics
    as process ``eval`` at step = the version evaluated."""
    from asyncrl.learner.eval_schedule import Evaluator
    from asyncrl.learner.trainer import LearnerError
    from asyncrl.metrics import MetricsSink
    from asyncrl.plugins import PluginError
    from asyncrl.rollout.prompts import PromptDataError

    if not recipe.data.eval_path or not recipe.run.eval_prompts:
        return None
    try:
        evaluator = Evaluator.from_recipe(
            recipe, note=report.display.note if report is not None else None
        )
    except (PromptDataError, PluginError) as e:
        raise LearnerError(f"held-out evaluation: {e}") from None
    if evaluator is not None:
        evaluator.metrics = MetricsSink.from_recipe(recipe, process="eval")
    return evaluator


def _finish(recipe: Recipe, trainer: Any, *, outcome: str, wall_seconds: float) -> None:
    """The run's summary, evaluation and plots, and where they are (rank 0, at a clean end)."""
    from asyncrl import summary

    stats = trainer.source.stats()
    status = {"version": trainer.version, **stats} if stats is not None else None
    s = summary.finish_run(
        recipe,
        run_dir=trainer.run_dir,
        outcome=outcome,
        wall_seconds=wall_seconds,
        status=status,
    )
    path = trainer.run_dir / summary.SUMMARY_FILE
    print(
        f"asyncrl learner: {outcome} at version {trainer.version}; summary: {path}, "
        f"plots: {trainer.run_dir / 'plots'}",
        file=sys.stderr,
        flush=True,
    )
    print(summary.summary_line(s), flush=True)


def _say_error(e: BaseException) -> None:
    """One line on stderr in one write: under torchrun every rank says it, and two ranks' lines
    must not interleave (``print`` writes the text and its newline apart on an unbuffered stream)."""
    sys.stderr.write(f"asyncrl learner: {e}\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(
        prog="asyncrl learner",
        description="Train with the TorchTitan learner (alone, or under torchrun for N ranks).",
    )
    p.add_argument("recipe", help="YAML recipe")
    p.add_argument("overrides", nargs="*", help="section.key=value")
    a = p.parse_intermixed_args(argv)  # flags and overrides in any order, as `asyncrl run`
    try:
        recipe = recipe_mod.load(a.recipe, a.overrides)
    except recipe_mod.RecipeError as e:
        _say_error(e)
        return 2
    from asyncrl.learner.dataset_sources import DataError
    from asyncrl.learner.model_spec import ModelConfigError
    from asyncrl.learner.trainer import LearnerError

    try:
        return train(recipe, invocation=Invocation(recipe_path=a.recipe, overrides=a.overrides))
    except (DataError, ModelConfigError, LearnerError, SourceError, recipe_mod.RecipeError) as e:
        _say_error(e)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
