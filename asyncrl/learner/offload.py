"""Parameter reallocation: a role gives its device memory back between its calls and takes it back
before the next (``placement.<role>.offload``; docs/placement.md).

Roles that share ranks run one after another (π_ref's forward, then the critic's values, then the
actor's updates...), yet each keeps its float32 parameters, gradients and AdamW moments on the
device all the time. :class:`Offloader` copies a role's tensors to host memory (one buffer a role,
page-locked on CUDA: :func:`host_buffer`) and frees their device storage
(``untyped_storage().resize_(0)``, as FSDP2 frees its all-gather buffers), then reallocates the
SAME storages and copies the bytes back. Every tensor keeps its storage object, so FSDP2 (its
``FSDPParam`` keeps the padded shard ``_sharded_param_data``, of which the parameter's local
tensor is a view), the optimizer (its state is keyed by the parameter objects) and any view see
the reloaded bytes without being told.

This is not FSDP2's ``CPUOffloadPolicy`` (TorchTitan's ``training.enable_cpu_offload``): there the
sharded parameters live on the host for good and every all-gather copies them up, every
reduce-scatter's gradient down, and AdamW steps on the CPU. Here the role computes entirely on the
device while it runs; the copies happen once per step, at the role's first and last calls.

Pure mechanism: which roles offload, and when, is the trainer's (it reads the recipe).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def role_tensors(
    model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()
) -> Iterator[torch.Tensor]:
    """The role's tensors that hold memory between calls: each parameter's local shard, its
    gradient, and the optimizers' state (AdamW: ``exp_avg``, ``exp_avg_sq``, ``step``)."""
    for p in model.parameters():
        yield _local(p.detach())
        if p.grad is not None:
            yield _local(p.grad)
    for opt in optimizers:
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    yield _local(v)


HOST_ALIGN = 512
"""Each storage's bytes start at a multiple of this in its role's host buffer: the alignment of the
device storages themselves (CUDA's caching allocator), at most 511 bytes lost per storage."""


def host_layout(sizes: Sequence[int], align: int = HOST_ALIGN) -> tuple[list[int], int]:
    """(offset of each storage in one host buffer, the buffer's bytes): the storages one after
    another, each at the next multiple of ``align``."""
    offsets, end = [], 0
    for n in sizes:
        start = -(-end // align) * align
        offsets.append(start)
        end = start + n
    return offsets, end


def pow2_ceil(n: int) -> int:
    """The size torch's caching host allocator reserves for a pinned request of ``n`` bytes
    (``CachingHostAllocatorImpl::allocate``: ``c10::llvm::PowerOf2Ceil`` under the default
    ``pinned_max_round_threshold``)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def host_bytes(sizes: Sequence[int]) -> dict[str, int]:
    """Host bytes a role's storages of ``sizes`` bytes take when offloaded, by layout:
    ``per_storage_pinned``: one ``torch.empty(n, pin_memory=True)`` per storage, each rounded up to
    a power of two by the caching host allocator (and kept, as the offloader keeps its buffers);
    ``one_pinned``: one such buffer for all of them (one rounding); ``one_registered``: one plain
    buffer page-locked with ``cudaHostRegister`` (:func:`host_buffer`, this module's layout): the
    aligned sum, no rounding."""
    _, total = host_layout(sizes)
    return {
        "storage_bytes": sum(sizes),
        "per_storage_pinned": sum(pow2_ceil(n) for n in sizes),
        "one_pinned": pow2_ceil(total),
        "one_registered": total,
    }


def host_buffer(nbytes: int, *, pin: bool) -> torch.Tensor:
    """``nbytes`` of host memory (uint8), page-locked if ``pin`` (CUDA) so that the copies to and
    from the device are direct DMA.

    Not ``torch.empty(..., pin_memory=True)``: torch's caching host allocator rounds each request
    up to a power of two and keeps the block, up to twice a role's states in host memory for
    good. A plain allocation of the exact size registered with ``cudaHostRegister`` instead, as
    torch's own DCP stager pins its host copies (``torch.distributed.checkpoint``'s
    ``_state_dict_stager``, through ``torch.cuda._pin_memory_utils``), and unregistered when the
    buffer is collected."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if pin and nbytes:
        from torch.cuda import _pin_memory_utils

        _pin_memory_utils.pin_memory(buf.data_ptr(), nbytes)
        f = weakref.finalize(buf, _pin_memory_utils.unpin_memory, buf.data_ptr())
        f.atexit = False  # not after the CUDA context is gone (as the DCP stager)
    return buf


def _bytes(s: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of storage ``s`` (to copy it into a slice of a host buffer)."""
    return torch.empty(0, dtype=torch.uint8, device=s.device).set_(s, 0, (s.nbytes(),), (1,))


def reshard(model: torch.nn.Module) -> None:
    """Free FSDP2's unsharded (all-gathered) parameters and put the sharded ones back on the
    modules, so that the offload frees the shards and no gathered copy survives it.

    TorchTitan's root unit (embedding, final norm, output projection) does not reshard after
    forward, and a forward without a backward (π_ref's, the critic's values) leaves its parameter
    group gathered and in its forward state, where ``FSDPModule.reshard()`` returns without
    resharding; the group is then sharded directly (its state kept: the next forward gathers it
    again as after any reshard)."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
            # _fsdp_param_groups (a list) is torch >= 2.13's (older: one _fsdp_param_group), hence
            # pyproject's torch>=2.13 pin.
            for group in m._get_fsdp_state()._fsdp_param_groups:
                group._to_sharded()  # no-op when sharded


@dataclass(kw_only=True)
class Offloader:
    """One role's model and optimizers, on the device or on the host.

    ``offload()`` frees the role's device storages and returns the bytes freed; ``reload()``
    reallocates them and copies the bytes back (bitwise), returning the bytes reloaded. The host
    side is ONE buffer of the storages' summed sizes, each storage at an aligned offset in it
    (:func:`host_layout`, :func:`host_buffer`), kept and reused while the storages keep their
    sizes (pinning is slow)."""

    model: torch.nn.Module
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _storages: list[torch.UntypedStorage] = field(default_factory=list, init=False)
    _host: torch.Tensor | None = field(default=None, init=False)
    _sizes: list[int] = field(default_factory=list, init=False)
    _offsets: list[int] = field(default_factory=list, init=False)

    @property
    def offloaded(self) -> bool:
        return bool(self._storages)

    @property
    def host_nbytes(self) -> int:
        """Bytes of the role's host buffer (kept between offloads once made)."""
        return 0 if self._host is None else self._host.numel()

    def storages(self) -> list[torch.UntypedStorage]:
        """The role's distinct, non-empty storages on ``device`` (a storage shared by several
        tensors, such as a tied embedding or the padded shard and its view, counts once)."""
        seen: dict[int, torch.UntypedStorage] = {}
        for t in role_tensors(self.model, self.optimizers):
            s = t.untyped_storage()
            if s.device == self.device and s.nbytes() > 0:
                seen.setdefault(s.data_ptr(), s)
        return list(seen.values())

    def offload(self) -> int:
        """Copy the role's tensors to the host and free their device memory. Not during a call:
        between two (the autograd graph of an unfinished backward would still read them)."""
        if self.offloaded:
            return 0
        reshard(self.model)
        storages = self.storages()
        sizes = [s.nbytes() for s in storages]
        cuda = self.device.type == "cuda"
        if self._host is None or sizes != self._sizes:
            if self._host is not None and cuda:  # the last reload's copies read the old buffer
                torch.cuda.current_stream(self.device).synchronize()
            self._host = None  # the old buffer goes (and is unregistered) before the new one
            self._offsets, total = host_layout(sizes)
            self._host = host_buffer(total, pin=cuda)
            self._sizes = sizes
        for s, view in zip(storages, self._host_views(), strict=True):
            view.copy_(_bytes(s), non_blocking=True)
        if cuda:
            torch.cuda.current_stream(self.device).synchronize()  # the copies, before the frees
        for s in storages:
            s.resize_(0)
        self._storages = storages
        return sum(sizes)

    def reload(self) -> int:
        """Reallocate the role's storages on the device and copy their bytes back."""
        if not self.offloaded:
            return 0
        for s, view in zip(self._storages, self._host_views(), strict=True):
            s.resize_(view.numel())
            _bytes(s).copy_(view, non_blocking=True)
        self._storages = []
        return sum(self._sizes)

    def _host_views(self) -> list[torch.Tensor]:
        """Each storage's slice of the host buffer."""
        assert self._host is not None
        return [self._host[o : o + n] for o, n in zip(self._offsets, self._sizes, strict=True)]


@dataclass(kw_only=True)
class Reallocation:
    """When each offloaded role gives its memory back in a step: after the last dataflow level
    that calls it, and takes it back before the first (calls of one level run together: the
    critic's update runs inside the actor's train step)."""

    offloaders: dict[str, Offloader] = field(default_factory=dict)
    freed: dict[str, int] = field(default_factory=dict)
    """Bytes each role freed at its last offload."""

    def levels(self, levels: list[list[Any]]) -> Iterator[list[Any]]:
        """Yield the step's levels (lists of calls with a ``role``), reloading the roles a level
        calls before it and offloading those whose last level it was after it."""
        last = {c.role: i for i, level in enumerate(levels) for c in level}
        for i, level in enumerate(levels):
            for role in sorted({c.role for c in level}):
                self.reload(role)
            yield level
            for role in sorted(r for r, j in last.items() if j == i):
                self.offload(role)

    def offload(self, role: str) -> None:
        if role in self.offloaders:
            self.freed[role] = self.offloaders[role].offload() or self.freed.get(role, 0)

    def reload(self, role: str) -> None:
        if role in self.offloaders:
            self.offloaders[role].reload()

    def reload_all(self) -> None:
        """Every role back on the device (before a checkpoint reads their state)."""
        for role in self.offloaders:
            self.reload(role)
