"""One metrics sink for every process: a JSONL file in the run folder, and W&B (offline by default).

All processes of a run append to the same ``run_dir/metrics.jsonl``; each line is
``{"step": .., "time": .., "process": .., **metrics}``. Lines are written with one ``os.write`` on
an ``O_APPEND`` descriptor, which Linux keeps whole on a local file system, so the learner and the
rollout workers can share the file without locks; ``process`` tells their lines apart.

Each process is its own W&B run; they share ``group`` (the run's name) so W&B shows them together,
with ``job_type`` = process. ``WANDB_MODE`` in the environment overrides ``wandb_mode``; mode
``disabled`` (or ``use_wandb=False``) keeps only the JSONL file. W&B x-axis is the logged ``step``
(a metric, not W&B's own counter), so processes may log steps in any order.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

METRICS_FILE = "metrics.jsonl"


def _jsonable(v: Any) -> Any:
    """numpy and torch scalars and arrays become plain numbers and lists."""
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    item = getattr(v, "item", None)  # a torch tensor (not imported here: metrics must stay light)
    if callable(item) and getattr(v, "numel", lambda: 0)() == 1:
        return item()
    tolist = getattr(v, "tolist", None)
    if callable(tolist):
        return tolist()
    if isinstance(v, Path):
        return str(v)
    raise TypeError(f"metric value of type {type(v).__name__} is not a number, string or list")


def _plain_config(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    return dict(config)


def histogram(values: Iterable[float] | np.ndarray, bins: int = 32) -> dict[str, list]:
    """``{"hist": counts, "edges": edges}`` over the finite values (as numpy.histogram)."""
    arr = np.asarray(values, dtype=np.float64).ravel()
    arr = arr[np.isfinite(arr)]
    counts, edges = np.histogram(arr, bins=bins) if arr.size else (np.zeros(0), np.zeros(0))
    return {"hist": [int(c) for c in counts], "edges": [float(e) for e in edges]}


class MetricsSink:
    """Writes metrics of one process to the run's JSONL file and to its W&B run."""

    _open_wandb_runs = 0  # in this process; W&B is torn down (files flushed) when the last closes

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        name: str,
        group: str,
        config: Any = None,
        use_wandb: bool = True,
        wandb_mode: str = "offline",
        project: str = "asyncrl",
        process: str = "learner",
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.process = process
        self.path = self.run_dir / METRICS_FILE
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._run = None
        mode = os.environ.get("WANDB_MODE", wandb_mode)
        if use_wandb and mode != "disabled":
            import wandb  # imported only when used: it is slow to import

            self._wandb = wandb
            self._run = wandb.init(
                project=project,
                name=name if process == "learner" else f"{name}-{process}",
                group=group,
                job_type=process,
                config=_plain_config(config),
                dir=str(self.run_dir),
                mode=mode,
                reinit="create_new",
                settings=wandb.Settings(
                    silent=True,
                    console="off",
                    x_disable_stats=True,  # no sampling thread on a 2-core machine
                    x_disable_machine_info=True,
                ),
            )
            MetricsSink._open_wandb_runs += 1
            self._run.define_metric("step")
            self._run.define_metric("*", step_metric="step")

    @classmethod
    def from_recipe(cls, recipe: Any, *, process: str) -> MetricsSink:
        """The sink of one process of a run: the run folder, name, group and W&B settings of the
        recipe (so every process of a run joins one W&B group)."""
        lg = recipe.logging
        return cls(
            recipe.run_dir,
            name=recipe.run.name,
            group=lg.group or recipe.run.name,
            config=recipe.to_dict(),
            use_wandb=lg.wandb,
            wandb_mode=lg.wandb_mode,
            project=lg.project,
            process=process,
        )

    @property
    def wandb_run(self) -> Any:
        """The W&B run, or None when W&B is off."""
        return self._run

    def _write(self, record: dict[str, Any]) -> None:
        if self._fd is None:
            raise RuntimeError("MetricsSink is closed")
        line = json.dumps(record, default=_jsonable, separators=(",", ":")) + "\n"
        data = line.encode()
        written = os.write(self._fd, data)
        while written < len(data):  # only on a full disk or a signal; keep the line whole if we can
            written += os.write(self._fd, data[written:])

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """One JSONL line and one W&B history row; keys ``step``, ``time``, ``process`` are ours."""
        for k in ("step", "time", "process"):
            if k in metrics:
                raise ValueError(f"metric name {k!r} is reserved")
        record = {"step": int(step), "time": time.time(), "process": self.process, **metrics}
        self._write(record)
        if self._run is not None:
            row = {k: v for k, v in record.items() if k not in ("time", "process")}
            self._run.log(row)

    def log_histogram(
        self, name: str, values: Iterable[float] | np.ndarray, step: int, *, bins: int = 32
    ) -> None:
        """A distribution (e.g. staleness, importance ratios): counts and edges in both sinks."""
        h = histogram(values, bins=bins)
        self._write({"step": int(step), "time": time.time(), "process": self.process, name: h})
        if self._run is not None and h["hist"]:  # W&B cannot draw an empty one; JSONL has it
            value = self._wandb.Histogram(np_histogram=(h["hist"], h["edges"]))
            self._run.log({"step": int(step), name: value})

    def close(self) -> None:
        """Flush and finish W&B (idempotent); the run's files are complete when this returns."""
        if self._run is not None:
            run, self._run = self._run, None
            run.finish()
            MetricsSink._open_wandb_runs -= 1
            if MetricsSink._open_wandb_runs == 0:
                # finish() can return before the last run's records reach its .wandb file;
                # teardown waits for W&B's service to write everything (a later init restarts it).
                self._wandb.teardown()
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> MetricsSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(run_dir: str | os.PathLike, *, process: str | None = None) -> list[dict[str, Any]]:
    """All JSONL records of a run (optionally of one process), in file order.

    A torn last line (a process killed mid-write) is skipped; any other bad line raises ValueError
    naming the line.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON line: {e}") from None
        if process is None or rec.get("process") == process:
            out.append(rec)
    return out


# --------------------------------------------------------------------------------------------------
# Reading W&B offline runs back (tests and tools: what W&B will show is what we logged)
# --------------------------------------------------------------------------------------------------

_WANDB_BLOCK = 32 * 1024
_WANDB_HEADER = 7  # ":W&B" + magic 0xBEE1 + version byte; then leveldb-log records


def _wandb_records(path: Path) -> list[Any]:
    """The protobuf records of a ``.wandb`` file (leveldb log format, 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B transaction log")
    records, buf, pos = [], b"", _WANDB_HEADER
    while pos + 7 <= len(data):
        left = _WANDB_BLOCK - pos % _WANDB_BLOCK
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # block padding
            pos += left
            continue
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(buf)
            records.append(rec)
            buf = b""
    return records


def read_wandb_offline(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every offline W&B run under ``run_dir/wandb``: name, group, job_type, config and history."""
    runs = []
    for path in sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb")):
        info: dict[str, Any] = {"path": str(path), "history": [], "config": {}}
        for rec in _wandb_records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                info.update(
                    name=rec.run.display_name, group=rec.run.run_group, job_type=rec.run.job_type
                )
                for item in rec.run.config.update:
                    info["config"][item.key] = json.loads(item.value_json)
            elif kind == "history":
                row: dict[str, Any] = {}
                for item in rec.history.item:
                    key = item.key or "/".join(item.nested_key)
                    row[key] = json.loads(item.value_json)
                info["history"].append(row)
        runs.append(info)
    return runs
