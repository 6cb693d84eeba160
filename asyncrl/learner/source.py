"""Where the learner's batches come from, and how every rank gets the same batch.

A :class:`BatchSource` lives on rank 0 only (the RL buffer service, or the local sft dataset). Rank 0
pulls a batch and broadcasts its wire encoding (raw bytes in a uint8 tensor, never a pickle) to the
other ranks; every rank then decodes the whole batch and takes its own shard of sequences, so the
advantages (which need whole groups) are computed identically everywhere.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import msgpack
import torch
import torch.distributed as dist

from asyncrl import wire
from asyncrl.buffer.store import Batch

if TYPE_CHECKING:
    from asyncrl.buffer.service import RegisterCallback

__all__ = [
    "Batch",
    "BatchSource",
    "Signal",
    "SourceError",
    "broadcast_batch",
    "decode_batch",
    "encode_batch",
]


@runtime_checkable
class BatchSource(Protocol):
    """Hands out one batch of whole groups per optimizer step (rank 0 only).

    The RL buffer service (:class:`~asyncrl.buffer.service.BufferService`) speaks all of it; it
    lives below the learner, so it matches this protocol by its methods rather than by subclassing
    it. A local data set (:mod:`asyncrl.learner.dataset_sources`) subclasses it and keeps the
    defaults of what only a service has (workers to tell, generators to watch, a task to stop), so the learner
    calls every method on every source and never asks which kind it has."""

    def next_batch(self, timeout_s: float) -> Batch:
        """The next batch; raises ``TimeoutError`` after ``timeout_s`` seconds without one."""
        ...

    def set_version(self, v: int, checkpoint: str = "") -> None:
        """The learner has produced version ``v`` (and, if non-empty, an HF export of it)."""
        ...

    def adapt_depth(self, metrics: dict[str, float]) -> None:
        """A step's metrics, for a service whose admission follows the drift
        (``buffer.adaptive_depth_*``); a local data set has no pipeline."""
        return None

    def state_dict(self) -> dict:
        """JSON-able state to checkpoint with the learner (buffer counters, data position)."""
        ...

    def load_state_dict(self, d: dict) -> None: ...

    def on_register(self, callback: RegisterCallback) -> None:
        """Call ``callback(worker_id, generators)`` on every worker's Register (the broadcaster's:
        its generators). A local data set has no workers."""
        return None

    def watch_generators(self, dropped: Callable[[], dict[str, str]]) -> None:
        """``dropped()``: the generators the learner sends no weights to, url -> why, for the
        source to say while the learner waits. A local data set feeds no generators."""
        return None

    def waiting_cause(self) -> str:
        """What a wait for a batch waits on, for the timeout's message ("" if nothing to say: a
        local data set never makes the learner wait)."""
        return ""

    def stats(self) -> dict[str, Any] | None:
        """Counters for the run's summary (None: a local data set has none to report)."""
        return None

    def end_run(self, message: str = "") -> None:
        """The learner has trained its last version: a service tells its workers to end."""
        return None

    def stop(self) -> None:
        """Rank 0 is leaving: a service stops serving (after the summary is written, so that
        workers' last releases are still answered)."""
        return None


class SourceError(RuntimeError):
    """Rank 0 could not produce a batch; every rank raises this with the same message."""


def encode_batch(batch: Batch) -> bytes:
    """Batch -> bytes: the groups in the wire codec, version and numeric stats in msgpack."""
    stats = {k: v for k, v in batch.stats.items() if isinstance(v, int | float | str | bool)}
    return msgpack.packb(
        {
            "groups": [wire.encode(g) for g in batch.groups],
            "version": int(batch.version),
            "stats": stats,
        },
        use_bin_type=True,
    )


def decode_batch(data: bytes) -> Batch:
    d = msgpack.unpackb(data, raw=False, max_bin_len=wire.MAX_MESSAGE_BYTES)
    groups = [wire.decode(g, expect=wire.Group) for g in d["groups"]]
    return Batch(groups=groups, version=int(d["version"]), stats=dict(d["stats"]))


_DATA, _ERROR, _STOP, _PUBLISH = 0, 1, 2, 3
POLL_S = 1.0
"""Rank 0 asks its source for a batch in slices of this many seconds, so a stop request is heard."""


def _broadcast(kind: int, payload: bytes, *, src: int = 0) -> tuple[int, bytes]:
    """(kind, payload) from ``src`` to every rank: a header tensor, then the bytes as uint8."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return kind, payload
    header = torch.tensor([len(payload), kind], dtype=torch.int64)
    dist.broadcast(header, src=src)
    n, kind = int(header[0]), int(header[1])
    if dist.get_rank() == src and n:
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    else:
        buf = torch.empty(n, dtype=torch.uint8)
    if n:
        dist.broadcast(buf, src=src)
    return kind, buf.numpy().tobytes()


def broadcast_bytes(data: bytes | None, *, src: int = 0, error: str = "") -> bytes:
    """Send ``data`` from ``src`` to every rank. ``error`` on ``src`` makes every rank raise it."""
    kind, out = _broadcast(
        _ERROR if error else _DATA, error.encode() if error else data or b"", src=src
    )
    if kind == _ERROR:
        raise SourceError(out.decode(errors="replace"))
    return out


class Signal(enum.Enum):
    """What :func:`broadcast_batch` returns on every rank instead of a batch (see there)."""

    STOP = "stop"
    """A clean stop was asked for on rank 0 while it waited: every rank checkpoints and leaves."""
    PUBLISH = "publish"
    """A generator waits for the learner's weights: publish them, then wait on."""


def broadcast_batch(
    source: BatchSource | None,
    *,
    timeout_s: float,
    waited_s: float = 0.0,
    wants_publish: Callable[[], bool] | None = None,
    settling: Callable[[], bool] | None = None,
    stop: threading.Event | None = None,
) -> Batch | Signal:
    """Rank 0 pulls from ``source``; every rank returns the same decoded batch (collective).

    Returns :attr:`Signal.STOP` on every rank when ``stop`` (rank 0's: set by the learner's
    SIGTERM handler) is set while it waits (a clean stop); raises :class:`SourceError` on every
    rank when rank 0 gets no batch within ``timeout_s`` of a wait that began ``waited_s`` ago,
    naming what the source says it waits on (:meth:`~BatchSource.waiting_cause`). Returns
    :attr:`Signal.PUBLISH` on every rank when ``wants_publish()`` (rank 0, between polls) is
    true: a generator waits for the learner's weights, and its data may be what this wait needs;
    the caller then publishes and calls again with the time already waited, so that publishing
    never restarts the bound.

    ``settling()`` (rank 0) is true while a generator's place is being decided: it waits to join,
    or a version is on its way to the generators. Its verdict (a generator dropped, and why) is
    the cause the timeout's message must name, so at the deadline the wait goes on until the
    verdict is in (publishing first if a generator still waits for weights), for at most another
    ``timeout_s``. Without this the message raced the verdict: on a loaded machine the deadline
    could come while the weights were still on their way to a generator no one can reach.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    kind, payload = _DATA, b""
    if rank == 0:
        deadline = time.monotonic() + timeout_s - waited_s
        while True:
            if stop is not None and stop.is_set():
                kind = _STOP
                break
            left = deadline - time.monotonic()
            if source is not None and left <= 0 and left > -timeout_s and settling and settling():
                if wants_publish is not None and wants_publish():
                    kind = _PUBLISH
                    break
                left = POLL_S  # the verdict comes from the weights' own bounded sync
            if source is None or left <= 0:
                kind = _ERROR
                if source is None:
                    payload = b"rank 0 has no batch source"
                else:
                    cause = source.waiting_cause()
                    said = f": {cause}" if cause else ""
                    payload = f"no batch within {timeout_s:g} s (buffer.batch_timeout_s){said}"
                    payload = payload.encode()
                break
            try:
                payload = encode_batch(source.next_batch(min(left, POLL_S)))
                break
            except TimeoutError:
                if wants_publish is not None and wants_publish():
                    kind = _PUBLISH
                    break
                continue
            except Exception as e:  # every rank must hear of it, or the others wait forever
                kind, payload = _ERROR, f"{type(e).__name__}: {e}".encode()
                break
    kind, payload = _broadcast(kind, payload)
    if kind == _ERROR:
        raise SourceError(payload.decode(errors="replace"))
    if kind == _STOP:
        return Signal.STOP
    if kind == _PUBLISH:
        return Signal.PUBLISH
    return decode_batch(payload)
