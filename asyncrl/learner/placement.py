"""Where each learner role runs (the recipe's ``placement``; docs/design.md §11): one
:class:`RoleMesh` per role, in ReaL's three levels — the global group (every learner rank: the
batch, the exchanges between roles, the step's metrics), the role's sub-group (its ranks: its
micro-batch count, its loss normaliser) and the parallel groups inside it (TorchTitan's
``ParallelDims`` over the role's ranks: FSDP2's data-parallel sharding, and tensor parallelism from
the role's ``tensor_parallel``). A role's parallel layout is built here and nowhere else.

Roles on the same ranks share one mesh and run their calls in the dataflow's order; roles on
disjoint ranks run theirs at the same time, each splitting the batch over its own ranks. What one
role needs from another crosses the global group (:func:`exchanges` says which keys, before which
call).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torchtitan.distributed.parallel_dims as tt_parallel_dims
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.config.configs import ParallelismConfig
from torchtitan.distributed import ParallelDims

from asyncrl.learner import cpu_shims
from asyncrl.learner.packing import Sequence, split_over_ranks
from asyncrl.recipe import PlacementConfig

if TYPE_CHECKING:
    from asyncrl.dataflow import Dataflow

LEARNER_INFERENCE = ("prox", "ref", "values")
"""The learner's forward-only calls: each stores a per-token key on every :class:`Sequence` of its
role's share (``prox_logp``, ``ref_logp``, ``values``), the only keys one role computes for
another."""


def role_ranks(placement: PlacementConfig, world: int, roles: tuple[str, ...]) -> dict[str, tuple]:
    """Each of ``roles``' ranks (sorted) in a learner of ``world`` ranks. Pure."""
    return {role: tuple(sorted(placement.ranks_of(role, world))) for role in roles}


def exchanges(flow: Dataflow, ranks: dict[str, tuple], world: int) -> dict[str, tuple[str, ...]]:
    """Before which call (by name) which keys must cross the global group: a key one of the
    learner's forward-only calls produces is exchanged before its first reader that runs on other
    ranks than its producer (the driver's calls run on every rank). Empty when every role is on
    every rank. Pure."""
    everyone = tuple(range(world))
    producer = {k: c for c in flow.calls for k in c.outputs if c.name in LEARNER_INFERENCE}
    out: dict[str, tuple[str, ...]] = {}
    sent: set[str] = set()
    for level in flow.order():
        for c in level:
            where = ranks.get(c.role, everyone)
            keys = tuple(
                k
                for k in c.inputs
                if k in producer and k not in sent and ranks[producer[k].role] != where
            )
            if keys:
                out[c.name] = keys
                sent.update(keys)
    return out


@contextmanager
def _root_mesh_over(ranks: tuple[int, ...]) -> Iterator[None]:
    """While TorchTitan's ``ParallelDims.build_mesh`` runs, its root mesh is ``ranks``' (it asks
    ``init_device_mesh`` for the whole world; every mesh it derives unflattens that root)."""
    original = tt_parallel_dims.init_device_mesh

    def init_device_mesh(
        device_type: str, shape: tuple[int, ...], *, mesh_dim_names: tuple[str, ...]
    ) -> DeviceMesh:
        assert shape == (len(ranks),), (shape, ranks)
        return DeviceMesh(device_type, torch.tensor(ranks), mesh_dim_names=mesh_dim_names)

    tt_parallel_dims.init_device_mesh = init_device_mesh
    try:
        yield
    finally:
        tt_parallel_dims.init_device_mesh = original


@dataclass(eq=False)
class RoleParallelDims(ParallelDims):
    """TorchTitan's ``ParallelDims`` over a subset of the learner's ranks (``world_size`` is the
    role's size). Building it is collective over the global group: every rank builds every role's
    mesh, in the same order (process groups are created by all ranks); a rank outside ``ranks``
    gets meshes it is not a coordinate of and must not use."""

    ranks: tuple[int, ...] = ()

    def build_mesh(self) -> DeviceMesh:
        if len(self.ranks) == dist.get_world_size():  # the whole world: TorchTitan's own way
            return super().build_mesh()
        with _root_mesh_over(self.ranks):
            return super().build_mesh()


@dataclass(eq=False)
class RoleMesh:
    """One placement of the learner: its ranks, TorchTitan's parallelism config and parallel dims
    over them, and this rank's place in it."""

    ranks: tuple[int, ...]
    parallelism: ParallelismConfig
    parallel_dims: RoleParallelDims
    rank: int  # this process's global rank
    whole_world: bool  # the role spans every learner rank: its group is the global one

    @property
    def holds(self) -> bool:
        """Whether this rank is one of the role's (holds its model, runs its calls)."""
        return self.rank in self.ranks

    @property
    def index(self) -> int:
        return self.ranks.index(self.rank)

    @property
    def leader(self) -> bool:
        """The role's first rank: the one that reports the role's per-step numbers."""
        return self.rank == self.ranks[0]

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The role's sub-group for collectives over its ranks (None: the global group, which it
        spans). Only a rank of the role may use it."""
        if self.whole_world:
            return None
        assert self.holds, (self.rank, self.ranks)
        return self.parallel_dims.world_mesh.get_group()

    def share(self, seqs: list[Sequence]) -> list[Sequence]:
        """This rank's sequences of the role (balanced by tokens over its ranks; none off it)."""
        return split_over_ranks(seqs, len(self.ranks))[self.index] if self.holds else []


def build_role_meshes(
    placement: PlacementConfig, world: int, rank: int, roles: tuple[str, ...]
) -> dict[str, RoleMesh]:
    """A mesh per role of ``roles`` (collective: every rank, the same roles). Roles on the same
    ranks with the same tensor-parallel degree share one mesh (and its process groups)."""
    by_layout: dict[tuple, RoleMesh] = {}
    out: dict[str, RoleMesh] = {}
    for role, ranks in role_ranks(placement, world, roles).items():
        tp = getattr(placement, role).tensor_parallel
        if role == "ref" and not placement.ref.ranks:
            tp = placement.actor.tensor_parallel  # it follows the actor
        layout = (ranks, tp)
        if layout not in by_layout:
            parallelism = ParallelismConfig(
                spmd_backend=cpu_shims.SPMD_BACKEND,
                data_parallel_shard_degree=-1,
                tensor_parallel_degree=tp,
            )
            dims = RoleParallelDims(
                dp_replicate=parallelism.data_parallel_replicate_degree,
                dp_shard=parallelism.data_parallel_shard_degree,
                cp=parallelism.context_parallel_degree,
                tp=parallelism.tensor_parallel_degree,
                pp=parallelism.pipeline_parallel_degree,
                ep=parallelism.expert_parallel_degree,
                world_size=len(ranks),
                spmd_backend=parallelism.spmd_backend,
                ranks=ranks,
            )
            dims.build_mesh()
            by_layout[layout] = RoleMesh(
                ranks=ranks,
                parallelism=parallelism,
                parallel_dims=dims,
                rank=rank,
                whole_world=len(ranks) == world,
            )
        out[role] = by_layout[layout]
    return out
