"""Parameter reallocation: a role gives its device memory back between its calls and takes it back
before the next (``placement.<role>.offload``; docs/placement.md).

Roles that share ranks run one after another (π_ref's forward, then the critic's values, then the
actor's updates...), yet each keeps its float32 parameters, gradients and AdamW moments on the
device all the time. :class:`Offloader` copies a role's tensors to host memory (pinned on CUDA) and
frees their device storage (``untyped_storage().resize_(0)``, as FSDP2 frees its all-gather
buffers), then reallocates the SAME storages and copies the bytes back. Every tensor keeps its
storage object, so FSDP2 (its ``FSDPParam`` keeps the padded shard ``_sharded_param_data``, of
which the parameter's local tensor is a view), the optimizer (its state is keyed by the parameter
objects) and any view see the reloaded bytes without being told.

This is not FSDP2's ``CPUOffloadPolicy`` (TorchTitan's ``training.enable_cpu_offload``): there the
sharded parameters live on the host for good and every all-gather copies them up, every
reduce-scatter's gradient down, and AdamW steps on the CPU. Here the role computes entirely on the
device while it runs; the copies happen once per step, at the role's first and last calls.

Pure mechanism: which roles offload, and when, is the trainer's (it reads the recipe).
"""

from __future__ import annotations

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
    reallocates them and copies the bytes back (bitwise), returning the bytes reloaded. Host
    buffers are kept and reused while the storages keep their sizes (pinned allocation is slow)."""

    model: torch.nn.Module
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _storages: list[torch.UntypedStorage] = field(default_factory=list, init=False)
    _host: list[torch.UntypedStorage] = field(default_factory=list, init=False)

    @property
    def offloaded(self) -> bool:
        return bool(self._storages)

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
        if [h.nbytes() for h in self._host] != sizes:
            pin = self.device.type == "cuda"
            self._host = [
                torch.empty(n, dtype=torch.uint8, pin_memory=pin).untyped_storage() for n in sizes
            ]
        for s, h in zip(storages, self._host, strict=True):
            h.copy_(s, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the copies, before the frees
        for s in storages:
            s.resize_(0)
        self._storages = storages
        return sum(sizes)

    def reload(self) -> int:
        """Reallocate the role's storages on the device and copy their bytes back."""
        if not self.offloaded:
            return 0
        for s, h in zip(self._storages, self._host, strict=True):
            s.resize_(h.nbytes())
            s.copy_(h, non_blocking=True)
        n = sum(h.nbytes() for h in self._host)
        self._storages = []
        return n


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
