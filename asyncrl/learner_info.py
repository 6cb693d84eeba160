"""``learner.json``: where the learner listens, and whether the run has ended.

Learner rank 0 writes it (:mod:`asyncrl.learner.report`); a rollout worker joining by
``--learner-file``, `asyncrl run` and scripts read it. It has a module of its own, below everyone
who reads it, so that a worker reads it without importing the run's end (:mod:`asyncrl.summary`,
which evaluates models on the rollout's code).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

LEARNER_FILE = "learner.json"


def write_whole(path: Path, text: str) -> None:
    """Write ``path`` whole (a reader never sees half of it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass(kw_only=True)
class LearnerInfo:
    """``run_dir/learner.json``, written by learner rank 0 once it listens, and again when the run
    ends: what a worker, a script or the sbatch launcher needs to join it, and whether to bother."""

    buffer_address: str
    pub_address: str
    weights_master: (
        str  # host:port of the weight group's TCPStore ("host:0": a free port per build)
    )
    rollout_command: str  # the `asyncrl rollout ...` line that joins this learner
    host: str
    pid: int
    version: int  # at start; at the end, the last version
    started_at: float  # Unix time
    ended_at: float | None = None  # set when the learner has trained its last version

    def write(self, run_dir: Path) -> Path:
        path = Path(run_dir) / LEARNER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, json.dumps(dataclasses.asdict(self), indent=2) + "\n")
        return path


def read_learner_info(where: str | Path) -> LearnerInfo | None:
    """The learner's ``learner.json`` (``where``: the run folder, or the file itself), or None if
    there is none (yet) or it is unreadable."""
    path = Path(where)
    if path.suffix != ".json":
        path = path / LEARNER_FILE
    try:
        d = json.loads(path.read_text())
        return LearnerInfo(**d)
    except (OSError, ValueError, TypeError):
        return None
