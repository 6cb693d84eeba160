"""Moving a decode step's small values between the host and the engine's device without stalling it.

On CUDA the host only queues work, and a step is fast only while it keeps queueing. Two things make
it wait for the GPU instead: reading a value back (``.item()``, ``.tolist()``, ``int(t)``), and a
copy from ordinary (pageable) host memory, which torch makes synchronous with the stream. So a step
sends what it needs in one copy from pinned memory that does not block (:func:`to_device`), and
reads back once, after sampling, everything the host needs (:func:`to_host`). On the CPU both are
plain tensors and lists: the same values, so the CPU engine computes exactly what it did before.
"""

from __future__ import annotations

import math

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a 1-d tensor on ``device``. On CUDA from pinned memory, without blocking:
    torch's caching host allocator keeps the pinned block from reuse until the copy has run, so
    the host need not wait for it."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def to_host(*parts: torch.Tensor) -> list[list]:
    """Each part's ``.tolist()``, all read back together: on CUDA in one transfer (one wait for
    the device, not one per part, :func:`one_read`); on the CPU part by part, which is what that
    transfer would give and costs less there (a few microseconds a step: no device to wait for)."""
    if parts[0].device.type != "cuda":
        return [p.tolist() for p in parts]
    return one_read(parts)


def one_read(parts: tuple[torch.Tensor, ...]) -> list[list]:
    """Parts of the same row count (1-d or 2-d) as one float64 tensor, copied to the host once and
    cut back into each part's ``.tolist()`` in its own dtype: float64 holds every float32 value
    and every token id exactly, so each list is what the part's own ``.tolist()`` gives."""
    flat = [p.reshape(p.shape[0], math.prod(p.shape[1:])) for p in parts]  # 0 rows too
    host = torch.cat([f.to(torch.float64) for f in flat], dim=1).cpu()
    out, at = [], 0
    for p, f in zip(parts, flat, strict=True):
        w = f.shape[1]
        out.append(host[:, at : at + w].reshape(p.shape).to(p.dtype).tolist())
        at += w
    return out
