"""Copy one model's weights from one parallel layout into the same model in another (issue #22):
π_ref filled from the actor's just-loaded weights instead of reading the HF folder a second time.

One tensor at a time, so the peak is one full tensor beside the two models: the source's is
gathered (``full_tensor``: FSDP2's and tensor parallelism's all-gathers over the source's mesh),
the destination's local shard is sliced from it on each rank with no communication
(``distribute_tensor(..., src_data_rank=None)``: DTensor's own chunking, uneven shards included,
the layout FSDP2 keeps), and copied into the destination's existing local tensor. FSDP2 holds
references to its sharded storages (the parameter's local tensor is a view of
``_sharded_param_data``), so the parameters are written in place, never replaced.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


class ReshardError(RuntimeError):
    """Two models :func:`reshard` cannot copy between (one-line message)."""


def _ranks(tensors: dict[str, torch.Tensor]) -> set[int]:
    """The global ranks a model lives on: its DTensors' meshes (a plain tensor, as RoPE's cache, is
    on every one of them alike), or this rank alone when it has none."""
    meshes = {t.device_mesh for t in tensors.values() if isinstance(t, DTensor)}
    ranks = {r for m in meshes for r in m.mesh.flatten().tolist()}
    return ranks or {dist.get_rank() if dist.is_initialized() else 0}


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by name (tied parameters once, as ``named_parameters`` gives them)."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@torch.no_grad()
def reshard(src: nn.Module, dst: nn.Module | None) -> int:
    """Copy every parameter and buffer of ``src`` into ``dst``, the same model in another layout;
    returns the bytes of the full tensors gathered (the model's size in its dtype).

    Collective over ``src``'s ranks: every one of them calls it, in the same order. ``dst``'s ranks
    must be ``src``'s or a subset of them (a rank of ``src`` outside them passes ``dst=None`` and
    only takes part in the gathers); ranks outside ``src``'s are refused, as are two models whose
    names, shapes or dtypes differ. Both models must be sharded (after FSDP2's reshard), as after
    building and loading."""
    if src is None:
        raise ReshardError("reshard: this rank holds no source model (its ranks must cover dst's)")
    s_all = _tensors(src)
    d_all = _tensors(dst) if dst is not None else {}
    if dst is not None:
        want = {k: (tuple(v.shape), v.dtype) for k, v in s_all.items()}
        got = {k: (tuple(v.shape), v.dtype) for k, v in d_all.items()}
        if want != got:
            diff = sorted(set(want.items()) ^ set(got.items()), key=str)[:3]
            raise ReshardError(f"reshard: the models differ (name, shape, dtype): {diff}")
        if not _ranks(d_all) <= _ranks(s_all):
            raise ReshardError(
                f"reshard: the destination's ranks {sorted(_ranks(d_all))} are not all the "
                f"source's {sorted(_ranks(s_all))}"
            )
    moved = 0
    for name, s in s_all.items():
        d = d_all.get(name)
        full = s.full_tensor() if isinstance(s, DTensor) else s
        moved += full.numel() * full.element_size()
        if d is None:
            continue
        if isinstance(d, DTensor):
            mine = distribute_tensor(full, d.device_mesh, d.placements, src_data_rank=None)
            local = mine.to_local()
            target = d.to_local()
            if local.shape != target.shape:
                raise ReshardError(
                    f"reshard: {name}: slice {tuple(local.shape)} for a local shard of "
                    f"{tuple(target.shape)} ({d.placements})"
                )
            target.copy_(local)
        else:
            d.copy_(full)
        del full
    return moved
