"""`asyncrl rollout`: one rollout worker feeding the learner's buffer (docs/design.md §1, §6).

    asyncrl rollout RECIPE [key=value ...] [--buffer ADDRESS --pub ADDRESS | --learner-file FILE]
                    [--worker-id ID] [--shard I/N] [--data-state FILE] [--max-groups N]

``--buffer``/``--pub`` replace the recipe's ``buffer.address``/``buffer.pub_address`` (the learner
prints the whole command); ``--learner-file`` takes them from the ``learner.json`` a listening learner
writes to its run folder, waiting for it (for scripts). The worker runs until the learner announces
the end of the run, then stops, prints its summary (one JSON line) and exits 0. With
``generator.kind: builtin`` the worker starts ``generator.engines_per_worker`` built-in engines and
stops them on exit (from the newest HF export the learner has announced, labelled with its
version; else from ``model.path``, version 0), listening on ``generator.host`` (empty: loopback for
a learner on this host, else this host's address on the route to it: :mod:`asyncrl.reach`); with
``kind: sglang`` it drives ``generator.urls``. A first registration the learner refuses because it
cannot reach a generator ends the worker with that one line, exit 2 (a setting to fix).
``--shard I/N`` gives this worker every N-th prompt (default: from a ``workerI`` id and
``rollout.workers``). ``--data-state`` resumes the data position from a JSON file (a group's
``data_state``).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import re
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import trio

from asyncrl import progress, wire
from asyncrl import recipe as recipe_mod
from asyncrl.agents.tool_envs import ToolSet
from asyncrl.generator_http import GeneratorError
from asyncrl.gpu import trainer_nccl_env
from asyncrl.moe import RouteShape
from asyncrl.plugins import PluginError
from asyncrl.reach import LOOPBACK, HostError, dial_host, engine_host
from asyncrl.recipe import Recipe, RecipeError
from asyncrl.rollout.generator_pool import GeneratorPool
from asyncrl.rollout.prompts import PromptDataError, PromptSource
from asyncrl.rollout.sglang_protocol import SamplingParams
from asyncrl.rollout.worker import GeneratorUnreachable, RolloutWorker, WorkerError
from asyncrl.rollout.worker_config import WorkerConfig
from asyncrl.rollout.workflows import load_workflow
from asyncrl.served.model_reward import build_reward
from asyncrl.served.teacher import build_teacher

log = logging.getLogger("asyncrl.rollout")


class UsageError(ValueError):
    """A mistake on the command line or in the recipe: reported in one line, exit code 2."""


def replay_routes(r: Recipe) -> RouteShape | None:
    """The routes requests ask the generators for: the model's, with algorithm.routing_replay
    (``validate`` refused it on a dense model)."""
    if not r.algorithm.routing_replay:
        return None
    cfg = json.loads((Path(r.resolve(r.model.path)) / "config.json").read_text())
    return RouteShape.from_config(cfg)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="asyncrl rollout", description=__doc__.splitlines()[0])
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help="section.key=value")
    p.add_argument("--buffer", help="Req/Rep address of the buffer service")
    p.add_argument("--pub", help="Pub/Sub address of version announcements")
    p.add_argument(
        "--learner-file",
        default="",
        help="the learner.json of a listening learner (in its run folder): its addresses, waited "
        "for up to run.timeout_s; instead of --buffer and --pub",
    )
    p.add_argument(
        "--worker-id",
        default="",
        help="unique per worker; started again with the same id, a worker resumes its prompts and "
        "the buffer takes back its dead process's leases (default rollout-HOST-PID: a new worker)",
    )
    p.add_argument("--shard", default="", help="I/N: take every N-th prompt starting at I")
    p.add_argument("--data-state", default="", help="JSON file with a saved data position")
    p.add_argument("--max-groups", type=int, default=0, help="stop after N delivered groups")
    return p.parse_intermixed_args(argv)


def _shard(text: str, worker_id: str, workers: int) -> tuple[int, int]:
    if text:
        m = re.fullmatch(r"(\d+)/(\d+)", text)
        if not m or not int(m.group(1)) < int(m.group(2)):
            raise UsageError(f"--shard {text!r}: expected I/N with 0 <= I < N")
        return int(m.group(1)), int(m.group(2))
    m = re.fullmatch(r"worker(\d+)", worker_id)
    if m and workers > 1 and int(m.group(1)) < workers:
        return int(m.group(1)), workers
    return 0, 1


def build_source(r: Recipe, shard: tuple[int, int]) -> PromptSource:
    d = r.data
    if d.path:
        src = PromptSource.from_file(
            r.resolve(d.path),
            prompt_key=d.prompt_key,
            shuffle=d.shuffle,
            seed=r.run.seed,
            shard=shard,
        )
        if src.skipped:
            log.warning("%s: skipped %d malformed row(s)", d.path, len(src.skipped))
        return src
    if d.task:
        from asyncrl import tasks

        try:
            rows = tasks.examples(d.task, split="train", n=d.num_examples or 10000, seed=r.run.seed)
        except ValueError as e:
            raise UsageError(f"data.task: {e}") from None
        return PromptSource(
            rows, name=f"task:{d.task}", shuffle=d.shuffle, seed=r.run.seed, shard=shard
        )
    raise UsageError("data.path or data.task: the worker needs prompts")


def engine_weights(r: Recipe, learner_version: int | None) -> tuple[Path, int]:
    """The weights a worker's built-in engines start from, and their version: the newest HF export
    in the run folder that the learner has announced (a worker restarted mid-run then starts close
    to the learner), else ``model.path``, version 0. Exports above ``learner_version`` may be a
    lost run's (a learner resumed from an older checkpoint); with no version known, none is used."""
    from asyncrl.weights.exports import latest_export

    found = None
    if learner_version is not None:
        found = latest_export(r.run_dir / "hf", at_most=learner_version)
    return found if found is not None else (Path(r.resolve(r.model.path)), 0)


def learner_version(r: Recipe, timeout_s: float = 5.0) -> int | None:
    """The learner's current version from its buffer service, None if it does not answer (yet).
    Asked only when the run folder has HF exports: a fresh run's worker starts without waiting."""
    from asyncrl.buffer.client import buffer_status
    from asyncrl.weights.exports import latest_export

    if latest_export(r.run_dir / "hf") is None:
        return None
    status = buffer_status(r.buffer.address, r, timeout_s=timeout_s)
    return int(status["version"]) if status else None


def spawn_engines(
    r: Recipe, run_dir: Path, worker_id: str, weights: tuple[Path, int] | None = None
) -> list[Any]:
    """Launch this worker's built-in engines from ``weights`` (a model folder and its version;
    default ``model.path``, version 0) and return at once: each loads the model while the worker
    loads its tokenizer and metrics (:func:`wait_engines` then waits for them). On the CPU they are
    forked from this process once it has imported their modules (:mod:`asyncrl.engine.process`);
    nothing here has started a thread yet."""
    from asyncrl.engine import spawn_engine_process

    if r.generator.engines_per_worker < 1:
        raise UsageError("generator.engines_per_worker: a builtin worker needs at least 1")
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    model_dir, version = weights or (Path(r.resolve(r.model.path)), 0)
    if version:
        log.info("starting the engines from %s (version %d)", model_dir, version)
    lora = r.learner.lora
    start: Path | None = None
    if lora.enabled and version:
        # with LoRA the engines keep model.path's weights as the base and serve the export (a PEFT
        # adapter folder, or a merged one) over it: the next versions' adapters apply to that base
        model_dir, start = Path(r.resolve(r.model.path)), model_dir
    host = listen_host(r)
    return [
        spawn_engine_process(
            str(model_dir),
            host=host,
            port=r.generator.base_port + i if r.generator.base_port else 0,
            max_batch_size=r.generator.max_batch_size,
            weight_version=str(version),
            seed=r.run.seed + i,
            log_path=logs / f"engine-{worker_id}-{i}.log",
            device=r.generator.device,
            dtype=r.model.dtype,
            env=engine_env(r, os.environ),
            lora_rank=lora.rank,
            lora_alpha=lora.alpha,
            weights=start,
            fork=True,  # on the CPU: from here, where torch and transformers load once for both
        )
        for i in range(r.generator.engines_per_worker)
    ]


def listen_host(r: Recipe) -> str:
    """Where the built-in engines listen: ``generator.host``, or (left empty) loopback for a
    learner on this host and this host's address on the route to a remote one
    (:func:`asyncrl.reach.engine_host`); a :class:`UsageError` naming the key when it cannot work."""
    try:
        host = engine_host(r.generator.host, r.buffer.address)
    except HostError as e:
        raise UsageError(str(e)) from None
    if host != r.generator.host and host != LOOPBACK:
        log.info(
            "generator.host: the engines listen on %s (the learner is at %s)",
            host,
            r.buffer.address,
        )
    return host


def engine_env(r: Recipe, environ: Mapping[str, str]) -> dict[str, str]:
    """What a built-in engine that may run on CUDA (``generator.device`` auto or cuda) is launched
    with beyond this process's environment: the NCCL settings the learner sets for an NCCL weight
    group, so that both ends of the communicator agree (as SGLang's servers set them for
    themselves), and the bound of its nonblocking NCCL calls from ``weights.timeout_s`` (torch
    reads it once per process, before the first communicator). A value set by hand is kept;
    nothing for an engine on CPU (gloo only)."""
    on_cuda = r.generator.device != "cpu"
    return trainer_nccl_env(environ, uses_nccl=on_cuda, weights_timeout_s=r.weights.timeout_s)


def wait_engines(engines: list[Any], timeout_s: float) -> None:
    """Wait until every engine answers /health (``generator.startup_timeout_s``); if one does not,
    stop them all and raise :class:`GeneratorError` with its log's tail."""
    try:
        for e in engines:
            e.wait_healthy(max(timeout_s - (time.monotonic() - e.started_at), 0.0))
    except RuntimeError as err:
        for e in engines:
            e.stop()
        raise GeneratorError(f"built-in engine failed to start: {err}") from None


def make_metrics(r: Recipe, worker_id: str) -> Any:
    from asyncrl.metrics import MetricsSink

    return MetricsSink.from_recipe(r, process=worker_id)


def _audit_dir(r: Recipe) -> Path:
    """run_dir/audit: the ids of acknowledged groups, per worker (see RELIABILITY.md)."""
    d = r.run_dir / "audit"
    d.mkdir(parents=True, exist_ok=True)
    return d


async def run_worker(
    r: Recipe,
    *,
    worker_id: str,
    buffer_address: str,
    pub_address: str,
    urls: list[str],
    kind: str,
    source: PromptSource,
    tokenizer: Any,
    metrics: Any = None,
    max_groups: int = 0,
    engines: list[Any] = (),
    resume_data_state: bool = True,
) -> RolloutWorker:
    """Build the worker from the recipe and run it until the learner ends the run, a signal, or
    ``max_groups``; returns it (its counters, the version it saw, whether the run ended)."""
    from asyncrl.buffer.client import BufferClient
    from asyncrl.transport import TLS, Subscriber

    ro = r.rollout
    tls = TLS.from_config(r.buffer)
    reward = build_reward(r)
    teacher = build_teacher(r)
    workflow = load_workflow(ro.workflow)
    tools = ToolSet.from_specs(ro.tools, timeout_s=ro.tool_timeout_s)
    cfg = WorkerConfig.from_recipe(
        r,
        worker_id,
        max_groups=max_groups,
        acked_log=str(_audit_dir(r) / f"{worker_id}.acked.jsonl"),
    )
    with Subscriber(pub_address, tls=tls) as sub:
        async with (
            BufferClient(buffer_address, worker_id=worker_id, tls=tls) as buffer,
            GeneratorPool(
                urls,
                timeout_s=ro.request_timeout_s,
                # SGLang serves LoRA versions as named adapters: requests name theirs
                lora=r.learner.lora.enabled and r.generator.kind == "sglang",
                routes=replay_routes(r),
            ) as pool,
        ):
            await pool.wait_ready(r.generator.startup_timeout_s)
            worker = RolloutWorker(
                cfg,
                buffer=buffer,
                pool=pool,
                source=source,
                tokenizer=tokenizer,
                workflow=workflow,
                reward=reward,
                params=SamplingParams.from_recipe(ro),
                tools=tools,
                max_turns=ro.max_turns,
                subscriber=sub,
                generators=[wire.GeneratorInfo(url=u, kind=kind) for u in urls],
                metrics=metrics,
                teacher=teacher,
            )
            if resume_data_state:
                await load_data_state(buffer, source, worker_id, r.run.timeout_s)
            async with trio.open_nursery() as nursery:

                async def watch_engines() -> None:
                    """A built-in engine that dies ends the worker (exit 1): its launcher restarts
                    both, rather than the worker waiting on a generator that will not return."""
                    while True:
                        await trio.sleep(2.0)
                        for e in engines:
                            if not e.alive():
                                raise WorkerError(
                                    f"built-in engine {e.url} exited with code "
                                    f"{e.proc.returncode}; its log ends:\n{e.log_tail(5)}"
                                )

                async def on_signal() -> None:
                    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
                        async for _ in sigs:
                            log.info("stopping on signal")
                            worker.stop()
                            return

                nursery.start_soon(on_signal, name="signals")
                nursery.start_soon(watch_engines, name="engines")
                nursery.start_soon(show_progress, worker, r, name="progress")
                await worker.run()
                nursery.cancel_scope.cancel()
    return worker


async def show_progress(worker: RolloutWorker, r: Recipe) -> None:
    """Version, groups delivered, generated tokens/s (over the last 10 s) and generators up."""
    display = progress.Display(r.run.steps, enabled=r.logging.progress, label="asyncrl rollout")
    window: deque[tuple[float, int]] = deque()
    rate = None

    def show() -> None:
        up, total = int(worker.pool.stats()["generators_up"]), len(worker.pool.generators)
        c = worker.stats.counters
        display.update(
            worker.version,
            f"groups {c['groups_delivered']} delivered  gen {progress.fmt(rate, ',.0f')} tok/s  "
            f"generators {up}/{total} up",
        )

    try:
        while True:
            now, tokens = trio.current_time(), worker.stats.counters["tokens_generated"]
            window.append((now, tokens))
            while now - window[0][0] > 10.0:
                window.popleft()
            t_first, first = window[0]
            rate = (tokens - first) / (now - t_first) if now > t_first else None
            show()
            await trio.sleep(1.0)
    finally:
        show()  # where the worker ended
        display.close()


def worker_summary(worker: RolloutWorker, wall_seconds: float) -> dict[str, Any]:
    """What this worker did, printed as its last line (one JSON object)."""
    c = worker.stats.counters
    if worker.ended is not None:
        outcome = "run_ended"
    elif worker.cfg.max_groups and c["groups_delivered"] >= worker.cfg.max_groups:
        outcome = "max_groups"
    else:
        outcome = "stopped"
    return {
        "worker_id": worker.cfg.worker_id,
        "outcome": outcome,
        "version": worker.version,
        "groups_delivered": c["groups_delivered"],
        "groups_rejected": c["groups_rejected"],
        "groups_cancelled": c["groups_cancelled_stale"] + c["groups_cancelled_lease"],
        "groups_failed": c["groups_failed"],
        "groups_dropped_reward_failures": c["groups_dropped_reward_failures"],
        "reward_failures": c["reward_failures"],
        "episodes": c["episodes"],
        "tokens_generated": c["tokens_generated"],
        "greedy_tokens_generated": c["greedy_tokens_generated"],
        "tokens_per_s": round(c["tokens_generated"] / wall_seconds, 1)
        if wall_seconds > 0
        else None,
        "wall_seconds": round(wall_seconds, 2),
    }


async def load_data_state(
    buffer: Any, source: PromptSource, worker_id: str, timeout_s: float
) -> None:
    """Resume the data position the learner's checkpoint holds for this worker, if it holds one.

    Contract with the buffer: ``StatusReply.stats["data_states"][worker_id]`` is the
    ``Group.data_state`` of this worker's newest group that the restored buffer
    acknowledged (it is kept in the buffer state, so in the learner's checkpoint). Waits for the buffer to answer (the learner may
    still be starting); a buffer without ``data_states`` means a fresh start.
    """
    from asyncrl.buffer.client import BufferRefused
    from asyncrl.transport import TransportTimeout

    status = None
    quiet = progress.Throttle(log)  # a line a minute while the learner is not there
    with trio.move_on_after(timeout_s):
        while status is None:
            try:
                status = await buffer.status()
            except (TransportTimeout, BufferRefused) as e:
                quiet.warning("status", "waiting for the buffer service: %s", e)
                await trio.sleep(1.0)
    if status is None:
        return
    state = (status.stats.get("data_states") or {}).get(worker_id)
    if not state:
        return
    try:
        source.load_state_dict(state)
        log.info("resumed the data position from the learner's checkpoint: %s", state)
    except (PromptDataError, KeyError, TypeError, ValueError) as e:
        log.warning("cannot resume the data position (%s); starting from the beginning", e)


def learner_addresses(path: Path, timeout_s: float) -> tuple[str, str]:
    """The buffer and Pub/Sub addresses in a learner's learner.json, once a learner that has not
    ended its run wrote it (a finished run's file is waited past, as is a missing one)."""
    from asyncrl.learner_info import read_learner_info

    quiet = progress.Throttle(log)
    deadline = time.monotonic() + timeout_s
    while True:
        info = read_learner_info(path)
        if info is not None and info.ended_at is None:
            log.info("joining the learner on %s (from %s)", info.host, path)
            return info.buffer_address, info.pub_address
        if time.monotonic() > deadline:
            raise WorkerError(f"--learner-file {path}: no listening learner within {timeout_s:g} s")
        why = "ended its run" if info is not None else "does not exist yet"
        quiet.warning("wait", "waiting for a learner: %s %s", path, why)
        time.sleep(1.0)


def _lone(eg: BaseExceptionGroup) -> BaseException:
    """The single exception inside nested one-member groups, else the group itself."""
    e: BaseException = eg
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    return e


def main(argv: list[str]) -> int:
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        handlers=[progress.StderrHandler()],  # above the progress bar on a terminal
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    t0 = time.monotonic()
    a = parse_args(argv)
    engines: list[Any] = []
    metrics = None
    try:
        overrides = list(a.overrides)
        if a.learner_file:
            if a.buffer or a.pub:
                raise UsageError("--learner-file gives the addresses: drop --buffer and --pub")
            timeout_s = recipe_mod.load(a.recipe, overrides).run.timeout_s
            a.buffer, a.pub = learner_addresses(Path(a.learner_file), timeout_s)
        if a.buffer:
            overrides.append(f"buffer.address={a.buffer}")
        if a.pub:
            overrides.append(f"buffer.pub_address={a.pub}")
        r = recipe_mod.load(a.recipe, overrides)
        if not r.model.path:
            raise UsageError("model.path: the worker needs the model's tokenizer")
        worker_id = a.worker_id or f"rollout-{socket.gethostname()}-{os.getpid()}"
        source = build_source(r, _shard(a.shard, worker_id, r.rollout.workers))
        if a.data_state:
            try:
                source.load_state_dict(json.loads(Path(a.data_state).read_text()))
            except (OSError, ValueError, KeyError) as e:
                raise UsageError(f"--data-state {a.data_state}: {e}") from None
        load_workflow(r.rollout.workflow)  # report plug-in mistakes before starting engines
        build_reward(r)
        build_teacher(r)
        ToolSet.from_specs(r.rollout.tools)
        if r.generator.kind == "builtin":  # they load while the tokenizer and W&B start here
            engines = spawn_engines(r, r.run_dir, worker_id, engine_weights(r, learner_version(r)))
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(r.resolve(r.model.path))
        metrics = make_metrics(r, worker_id)
        if r.generator.kind == "builtin":
            wait_engines(engines, r.generator.startup_timeout_s)
            host = dial_host(engines[0].host, r.buffer.address)  # 0.0.0.0 is no address to dial
            urls = [f"http://{host}:{e.port}" for e in engines]
        else:
            urls = list(r.generator.urls)
        run = functools.partial(
            run_worker,
            r,
            worker_id=worker_id,
            buffer_address=r.buffer.address,
            pub_address=r.buffer.pub_address,
            urls=urls,
            kind=r.generator.kind,
            source=source,
            tokenizer=tokenizer,
            metrics=metrics,
            max_groups=a.max_groups,
            engines=engines,
            resume_data_state=not a.data_state,
        )
        try:
            worker = trio.run(run)
        except BaseExceptionGroup as eg:  # a nursery's lone error: report it as itself
            raise _lone(eg) from None
        log.info("delivered %d groups", worker.stats.counters["groups_delivered"])
        print(json.dumps(worker_summary(worker, time.monotonic() - t0)), flush=True)
        return 0
    except (RecipeError, UsageError, PluginError, PromptDataError, GeneratorUnreachable) as e:
        print(f"asyncrl rollout: {e}", file=sys.stderr)
        return 2
    except (WorkerError, GeneratorError) as e:
        print(f"asyncrl rollout: {e}", file=sys.stderr)
        return 1
    finally:
        if metrics is not None:
            metrics.close()
        for e in engines:
            e.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
