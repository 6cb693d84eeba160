"""Only for the GPU check (check.sh puts this folder on PYTHONPATH on the GPU host, nowhere else):
get TorchTitan 0.3 past its imports on an older torch than asyncrl supports (the lent host has torch
2.11; asyncrl needs 2.13+).

TorchTitan 0.3 imports ``torch.distributed.fsdp.DataParallelMeshDims`` at module level
(torchtitan/distributed/fsdp.py, full_dtensor.py), a class that torch 2.13 has and older torch may
not. The learner on one rank never passes one (TorchTitan sets ``dp_mesh_dims`` only under its
full-DTensor mode), so a stand-in of the same shape is enough to import; anything that would use it
fails loudly in ``fully_shard``, which then lacks the keyword.

TorchTitan 0.3's flex mask passes ``separate_full_blocks=`` to ``create_block_mask``
(torchtitan/models/common/decoder.py), a keyword torch 2.11 lacks: on the lent host the learner,
run and lora steps failed with a TypeError there. torch 2.11 always separates full blocks, which is
the keyword's ``True``, so a wrapper that accepts ``True`` and refuses ``False`` gives TorchTitan the
behaviour it asks for or a clear error (``False`` is TorchTitan's batch-invariant mode, which the
check never enables).

Results obtained through this shim are a proxy for the supported torch, not a verification of it
(docs/gpu.md). Each patch is applied when its module is first imported (an import hook), so processes
that never import torch pay nothing, and names imported from the module afterwards get the patched
object; on a torch that has the names and the keyword it does nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
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


def without_separate_full_blocks(create_block_mask: Callable) -> Callable | None:
    """A ``create_block_mask`` that takes ``separate_full_blocks`` for one that lacks it (torch
    2.11), or None when it has it. torch 2.11's takes no such keyword and always stores fully
    unmasked blocks apart (it calls ``_convert_mask_to_block_mask(..., separate_full_blocks=True)``
    unconditionally), so ``True`` is what it does anyway and ``False``, every block through the
    mask, is refused rather than silently ignored."""
    import inspect  # here, not at startup: a process that never imports torch pays nothing

    if "separate_full_blocks" in inspect.signature(create_block_mask).parameters:
        return None

    @functools.wraps(create_block_mask)
    def wrapper(*args, separate_full_blocks: bool = True, **kwargs):  # type: ignore[no-untyped-def]
        if not separate_full_blocks:
            raise NotImplementedError(
                "create_block_mask(separate_full_blocks=False): this torch always separates full "
                "blocks (torch 2.13's create_block_mask takes the keyword); tools/gpu/shim passes "
                "only True through"
            )
        return create_block_mask(*args, **kwargs)

    return wrapper


MISSING: dict[str, dict[str, object]] = {
    "torch.distributed.fsdp": {"DataParallelMeshDims": DataParallelMeshDims},
}
"""Module → names added when the module lacks them."""

WRAPPERS: dict[str, dict[str, Callable[[Callable], Callable | None]]] = {
    "torch.nn.attention.flex_attention": {"create_block_mask": without_separate_full_blocks},
}
"""Module → names replaced by what the function makes of them (None: kept as they are)."""

PATCHED: list[str] = []
"""``module.name`` of every stand-in put in place (the env step reports it)."""


def _patch(module: ModuleType) -> None:
    for name, value in MISSING.get(module.__name__, {}).items():
        if not hasattr(module, name):
            setattr(module, name, value)
            PATCHED.append(f"{module.__name__}.{name}")
    for name, wrap in WRAPPERS.get(module.__name__, {}).items():
        new = wrap(getattr(module, name))
        if new is not None:
            setattr(module, name, new)
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
        if name not in MISSING and name not in WRAPPERS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if __name__ == "sitecustomize":  # Python's startup import; a test loads it under another name
    sys.meta_path.insert(0, _Finder())
