"""What `asyncrl learner` (rank 0) tells its user and the workers: where it listens, how it is doing,
and that the run is over.

- At start: the addresses it actually listens on (port 0 resolved) and the exact `asyncrl rollout`
  line that joins them, printed and written to ``run_dir/learner.json`` (for scripts and the sbatch
  launcher).
- While it trains: a progress bar on a terminal, a line every 15 s in a log (version, reward,
  staleness, throughput, workers registered), and why it waits when it waits for data. The display
  is a named task of rank 0's control plane (asyncrl/control.py), refreshed once a second in a
  worker thread (it reads metrics.jsonl).
- At its last version: ``wire.End`` on the Pub/Sub channel (workers stop), and ``ended_at`` in
  learner.json (`asyncrl run` then knows a worker's exit 0 is its normal end).
"""

from __future__ import annotations

import os
import shlex
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import trio

from asyncrl import progress
from asyncrl.learner_info import LearnerInfo
from asyncrl.reach import ANY_HOST, is_loopback
from asyncrl.recipe import Recipe

if TYPE_CHECKING:
    from asyncrl.control import ControlPlane

NO_WORKER_HINT_S = 60.0
"""Waiting for data this long with no worker registered: say so, and how to start one."""
WAIT_SHOWN_AFTER_S = 5.0
"""Waiting for a batch this long: the progress line says what the buffer holds."""
REFRESH_S = 1.0
"""The progress display's refresh interval."""
END_LINGER_S = 3.0
"""The buffer service keeps answering this long after the end, so workers can give back starts."""
LINGER_POLL_S = 0.05
"""How often the lingering learner asks whether a lease is still live."""


@dataclass(kw_only=True)
class Invocation:
    """How this learner was started: what the `asyncrl rollout` line it prints must repeat."""

    recipe_path: str
    overrides: Sequence[str] = ()


def dialable(address: str) -> str:
    """``address`` as a peer dials it: a wildcard listen host (0.0.0.0) becomes this host's name."""
    parts = urlsplit(address)
    if not parts.scheme.endswith("tcp") or parts.hostname not in ANY_HOST:
        return address
    return f"{parts.scheme}://{socket.gethostname()}:{parts.port}"


def rollout_command(inv: Invocation | None, buffer: str, pub: str) -> str:
    """The `asyncrl rollout` line that joins this learner: same recipe and overrides, its addresses
    (the learner's own address overrides and ``run.resume`` are its business, not the worker's)."""
    own = ("buffer.address=", "buffer.pub_address=", "run.resume=")
    recipe = str(Path(inv.recipe_path).resolve()) if inv else "RECIPE"
    overrides = [o for o in (inv.overrides if inv else ()) if not o.startswith(own)]
    argv = ["asyncrl", "rollout", recipe, "--buffer", buffer, "--pub", pub, *overrides]
    return shlex.join(argv)


class LearnerReport:
    """Rank 0's messages and progress display; ``source`` is the buffer service (None for sft)."""

    def __init__(
        self,
        recipe: Recipe,
        trainer: Any,
        *,
        source: Any = None,
        invocation: Invocation | None = None,
    ) -> None:
        self.r = recipe
        self.trainer = trainer
        self.source = source
        self.invocation = invocation
        self.info: LearnerInfo | None = None
        self.waiting_since: float | None = None  # set by the training loop around a batch wait
        self.display = progress.Display(
            recipe.run.steps, enabled=recipe.logging.progress, label="asyncrl learner"
        )
        self.tail = progress.MetricsTail(trainer.run_dir / "metrics.jsonl")
        self._t0 = time.monotonic()
        self._last_hint = -float("inf")
        self._plane: ControlPlane | None = None
        self._progress_scope: trio.CancelScope | None = None
        self._progress_done: trio.Event | None = None

    # -- start -----------------------------------------------------------------------------------

    def announce(self) -> None:
        """Print where this learner listens and how to join it; write learner.json."""
        if self.source is None:
            return
        r = self.r
        buffer, pub = dialable(self.source.address), dialable(self.source.pub_address)
        w = r.weights
        master = f"{w.master_addr}:{w.master_port}"
        cmd = rollout_command(self.invocation, buffer, pub)
        self.info = LearnerInfo(
            buffer_address=buffer,
            pub_address=pub,
            weights_master=master,
            rollout_command=cmd,
            host=socket.gethostname(),
            pid=os.getpid(),
            version=self.trainer.version,
            started_at=time.time(),
        )
        path = self.info.write(self.trainer.run_dir)
        port = "" if w.master_port else " (a free port for each build of weight groups)"
        lines = [
            "asyncrl learner: listening on",
            f"  buffer (Req/Rep)         {buffer}",
            f"  versions (Pub/Sub)       {pub}",
            f"  weight group (TCPStore)  {master}{port}",
            f"  (also in {path})",
        ]
        if is_loopback(w.master_addr) and not is_loopback(urlsplit(buffer).hostname or ""):
            lines.append(
                f"  note: weights.master_addr={w.master_addr}: generators on other hosts cannot "
                "join the weight group; set weights.master_addr to this host's name"
            )
        lines += ["start a rollout worker with:", f"  {cmd}"]
        self.display.note("\n".join(lines))

    def start(self, plane: ControlPlane) -> LearnerReport:
        """Run the progress display as the task ``learner-progress`` of ``plane``."""
        self._plane = plane
        plane.start(self._progress, name="learner-progress")
        return self

    # -- while training --------------------------------------------------------------------------

    async def _progress(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            self._progress_scope, self._progress_done = scope, trio.Event()
            task_status.started()
            try:
                while True:
                    await trio.sleep(REFRESH_S)
                    try:
                        await trio.to_thread.run_sync(self.refresh)
                    except Exception as e:  # progress is a convenience: never the learner's end
                        self.display.note(f"asyncrl learner: progress display failed: {e}")
                        return
            finally:
                self._progress_done.set()

    async def _stop_progress(self) -> None:
        assert self._progress_scope is not None and self._progress_done is not None
        self._progress_scope.cancel()
        await self._progress_done.wait()  # a refresh in its thread finishes first

    def refresh(self) -> None:
        """One progress update (every second, from the control plane's progress task)."""
        self.tail.update()
        rl = self.source is not None
        info = progress.progress_info(self.tail, self.r.buffer.max_staleness, sft=not rl)
        since = self.waiting_since
        waited = time.monotonic() - since if since is not None else 0.0
        if rl:
            st = self.source.stats()
            workers = int(st.get("workers_registered", 0))
            info += f"  workers {workers}"
            if waited >= WAIT_SHOWN_AFTER_S:
                info += (
                    f"  waiting {waited:.0f} s of {self.r.buffer.batch_timeout_s:g} for a batch "
                    f"({self.source.waiting_cause()})"
                )
            alone = time.monotonic() - self._t0
            now = time.monotonic()
            if (
                workers == 0
                and since is not None
                and alone >= NO_WORKER_HINT_S
                and now - self._last_hint >= NO_WORKER_HINT_S
            ):
                self._last_hint = now
                cmd = self.info.rollout_command if self.info else "asyncrl rollout ..."
                self.display.note(
                    f"asyncrl learner: no rollout worker has registered for {alone:.0f} s; "
                    f"start one with:\n  {cmd}"
                )
        self.display.update(self.trainer.version, info)

    # -- the end ---------------------------------------------------------------------------------

    def end(self) -> None:
        """The run is complete: tell the workers (Pub/Sub, and ``run_ended`` replies) and
        learner.json."""
        v = self.trainer.version
        summary = self.trainer.run_dir / "summary.json"
        if self.source is not None:
            self.source.end_run(
                f"trained {v} versions (run.steps); the learner's summary: {summary}"
            )
        if self.info is not None:
            self.info.version, self.info.ended_at = v, time.time()
            self.info.write(self.trainer.run_dir)

    def linger(self) -> None:
        """Keep the service answering until every lease is given back (the workers' releases
        after the end), for at most ``END_LINGER_S`` after the end."""
        if self.info is None or self.info.ended_at is None:
            return
        deadline = self.info.ended_at + END_LINGER_S
        while time.time() < deadline:
            if self.source is not None and not self.source.stats()["leases_live"]:
                return
            time.sleep(LINGER_POLL_S)

    def close(self) -> None:
        if self._plane is not None:
            try:
                if self._progress_scope is not None:
                    self._plane.run(self._stop_progress)
                self.refresh()  # the last version on the bar
            except Exception:  # the plane has stopped (its failure is reported by the learner)
                pass
        self.display.close()
