"""What one version sends: its tensors packed into wire buckets (owned copies, never the live
tensors), tied copies sent once, and the CUDA event the sender waits on before reading them.

Pure packing: no process groups or HTTP here. The bucket layouts and the checksum both sides
compute are :mod:`asyncrl.weights.buckets`'.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.weights import buckets

TIED_PAIRS = (("lm_head.weight", "model.embed_tokens.weight"),)
"""(name, source): when both are sent and equal, only the source goes out, as SGLang's own test does."""


@dataclass
class Snapshot:
    """One version's weights as they go on the wire: buckets of owned tensors (never the live ones)."""

    version: int
    buckets: list[buckets.Bucket]
    payloads: list[list[torch.Tensor]]  # per bucket: what rank 0 broadcasts, in order
    nbytes: int
    snapshot_s: float = 0.0  # time to build it (the copy into buckets)

    def named(self) -> Iterable[tuple[str, torch.Tensor]]:
        for b in self.buckets:
            yield from zip(b.names, b.tensors, strict=True)


def drop_tied(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop ``lm_head.weight`` when it is the same storage as, or equal to, the input embedding."""
    out = dict(named)
    for name, source in TIED_PAIRS:
        a, b = out.get(name), out.get(source)
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
            continue
        if a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() or torch.equal(a, b):
            del out[name]
    return out


def make_snapshot(
    version: int,
    named: Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    bucket_bytes: int,
    load_format: str,
    copy: bool = True,
    shared: bool = False,
) -> Snapshot:
    """``named`` as wire buckets: floating tensors cast to ``dtype``, tied copies sent once.

    ``copy``: the snapshot must not share memory with ``named`` (the learner will change it). The
    flattened layout always copies; with ``list`` and ``copy=False`` tensors are sent as they are.
    ``shared``: flattened buckets on the CPU are made in shared memory, for handles to them
    (``weights.backend: ipc``, :func:`buckets.flatten`)."""
    named = drop_tied(named)

    def cast(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    itemsize = torch.empty((), dtype=dtype).element_size()

    def wire_bytes(t: torch.Tensor) -> int:
        return t.numel() * (itemsize if t.is_floating_point() else t.element_size())

    out_buckets: list[buckets.Bucket] = []
    payloads: list[list[torch.Tensor]] = []
    for group in buckets.make_buckets(named.items(), bucket_bytes, wire_bytes):
        tensors = [cast(t) for t in group.tensors]  # one bucket at a time bounds extra memory
        if load_format == "flattened_bucket":
            flat = buckets.flatten(tensors, shared=shared)  # the copy
            dts, shapes = [t.dtype for t in tensors], [list(t.shape) for t in tensors]
            views = buckets.unflatten(flat, dts, shapes)
            out_buckets.append(buckets.Bucket(names=group.names, tensors=views))
            payloads.append([flat])
        else:
            tensors = [
                t.clone(memory_format=torch.contiguous_format) if copy else t.contiguous()
                for t in tensors
            ]
            out_buckets.append(buckets.Bucket(names=group.names, tensors=tensors))
            payloads.append(tensors)
    total = sum(b.nbytes for b in out_buckets)
    return Snapshot(version=version, buckets=out_buckets, payloads=payloads, nbytes=total)


def cuda_ready(tensors: Iterable[torch.Tensor]) -> Any:
    """A CUDA event recorded on the producer's (current) stream after every kernel queued so far,
    those that make ``tensors`` included: call it once they are queued. None for CPU tensors."""
    first = next(iter(tensors), None)
    if first is None or not first.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event
