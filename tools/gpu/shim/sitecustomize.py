"""Only for the GPU check (check.sh puts this folder on PYTHONPATH on the GPU host, nowhere else):
get TorchTitan 0.3 past its imports on an older torch than asyncrl supports (the lent host has torch
2.11; asyncrl needs 2.13+).

TorchTitan 0.3 imports ``torch.distributed.fsdp.DataParallelMeshDims`` at module level
(torchtitan/distributed/fsdp.py, full_dtensor.py), a class that torch 2.13 has and older torch may
not. The learner on one rank never passes one (TorchTitan sets ``dp_mesh_dims`` only under its
full-DTensor mode), so a stand-in of the same shape is enough to import; anything that would use it
fails loudly in ``fully_shard``, which then lacks the keyword. Results obtained through this shim are
a proxy for the supported torch, not a verification of it (docs/gpu.md).

The patch is applied when ``torch.distributed.fsdp`` is first imported (an import hook), so processes
that never import torch pay nothing; on a torch that has the names it does nothing.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType


@dataclasses.dataclass(frozen=True)
class DataParallelMeshDims:
    """Stand-in for torch 2.13's class of the same name (same fields, same check)."""

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError(
                "At least one of shard or replicate must be set in DataParallelMeshDims"
            )


MISSING: dict[str, dict[str, object]] = {
    "torch.distributed.fsdp": {"DataParallelMeshDims": DataParallelMeshDims},
}
"""Module → names added when the module lacks them."""

PATCHED: list[str] = []
"""``module.name`` of every stand-in put in place (the env step reports it)."""


def _patch(module: ModuleType) -> None:
    for name, value in MISSING.get(module.__name__, {}).items():
        if not hasattr(module, name):
            setattr(module, name, value)
            PATCHED.append(f"{module.__name__}.{name}")


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
        if name not in MISSING:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


sys.meta_path.insert(0, _Finder())
