"""Moving a decode step's small values between the host and the engine's device without stalling it.

On CUDA the host only queues work, and a step is fast only while it keeps queueing. Two things make
it wait for the GPU instead: reading a value back (``.item()``, ``.tolist()``, ``int(t)``), and a
copy from ordinary (pageable) host memory, which torch makes synchronous with the stream. So a step
sends what it needs in one copy from pinned memory that does not block (:func:`to_device`), and
reads back once, after sampling, everything the host needs (:func:`to_host`). On the CPU both are
plain tensors and lists: the same values, so the CPU engine computes exactly what it did before.
"""

from __future__ import annotations

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a 1-d tensor on ``device``. On CUDA from pinned memory, without blocking:
    torch's caching host allocator keeps the pinned block from reuse until the copy has run, so
    the host need not wait for it."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def to_host(*parts: torch.Tensor) -> list[list[float]]:
    """Several 2-d tensors of the same row count read back in one transfer (one wait for the
    device, not one per tensor): row i of the answer is row i of each part, side by side, as
    floats. Float64 holds every float32 and every token id exactly, so each value is what a
    ``.tolist()`` of its own part would give (ids: ``int(x)``)."""
    both = torch.cat([p.to(torch.float64) for p in parts], dim=1)
    return both.tolist()
