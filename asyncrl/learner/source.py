"""Where the learner's batches come from, and how every rank gets the same batch.

A :class:`BatchSource` lives on rank 0 only (the RL buffer service, or the local sft dataset). Rank 0
pulls a batch and broadcasts its wire encoding (raw bytes in a uint8 tensor, never a pickle) to the
other ranks; every rank then decodes the whole batch and takes its own shard of sequences, so the
advantages (which need whole groups) are computed identically everywhere.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import msgpack
import torch
import torch.distributed as dist

from asyncrl import wire
from asyncrl.buffer.store import Batch

__all__ = ["Batch", "BatchSource", "SourceError", "broadcast_batch", "decode_batch", "encode_batch"]


@runtime_checkable
class BatchSource(Protocol):
    """Hands out one batch of whole groups per optimizer step (rank 0 only)."""

    def next_batch(self, timeout_s: float) -> Batch:
        """The next batch; raises ``TimeoutError`` after ``timeout_s`` seconds without one."""
        ...

    def set_version(self, v: int, checkpoint: str = "") -> None:
        """The learner has produced version ``v`` (and, if non-empty, an HF export of it)."""
        ...

    def state_dict(self) -> dict:
        """JSON-able state to checkpoint with the learner (buffer counters, data position)."""
        ...

    def load_state_dict(self, d: dict) -> None: ...


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


def broadcast_bytes(data: bytes | None, *, src: int = 0, error: str = "") -> bytes:
    """Send ``data`` from ``src`` to every rank. ``error`` on ``src`` makes every rank raise it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error:
            raise SourceError(error)
        assert data is not None
        return data
    rank = dist.get_rank()
    payload = error.encode() if error else (data or b"")
    header = torch.tensor([len(payload), 1 if error else 0], dtype=torch.int64)
    dist.broadcast(header, src=src)
    n, is_error = int(header[0]), bool(header[1])
    buf = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if rank == src and n
        else torch.empty(n, dtype=torch.uint8)
    )
    if n:
        dist.broadcast(buf, src=src)
    out = buf.numpy().tobytes()
    if is_error:
        raise SourceError(out.decode(errors="replace"))
    return out


def broadcast_batch(source: BatchSource | None, *, timeout_s: float) -> Batch:
    """Rank 0 pulls from ``source``; every rank returns the same decoded batch (collective)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    data, error = None, ""
    if rank == 0:
        if source is None:
            error = "rank 0 has no batch source"
        else:
            try:
                data = encode_batch(source.next_batch(timeout_s))
            except Exception as e:  # every rank must hear of it, or the others wait forever
                error = f"{type(e).__name__}: {e}"
    return decode_batch(broadcast_bytes(data, error=error))
