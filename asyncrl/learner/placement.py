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

The rules a layout obeys (each role's ranks exist, split into its tensor-parallel groups, equal or
miss another role's; a critic beside the actor shares its tensor parallelism; when π_ref is the
LoRA actor's base) are in asyncrl/recipe/layout.py, under the recipe: a recipe is checked against
them when it loads, without torch, and trainer.py checks them again with the world size before
this module builds the meshes.
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


def role_parallelism(placement: PlacementConfig, role: str) -> ParallelismConfig:
    """TorchTitan's parallelism of one role: ``tensor_parallel`` ranks per tensor-parallel group
    (TorchTitan's plan for Qwen3 and Llama: attention and MLP column/row-wise, the embedding and
    the output projection sharded over the vocabulary), FSDP2 over the role's other ranks.

    Sequence parallelism stays off: the final norm's output (the hidden states the chunked output
    projection reads) is then replicated over the tensor-parallel group, the same rows on each."""
    return ParallelismConfig(
        spmd_backend=cpu_shims.SPMD_BACKEND,
        data_parallel_shard_degree=-1,
        tensor_parallel_degree=getattr(placement, role).tensor_parallel,
        enable_sequence_parallel=False,
    )


LEARNER_INFERENCE = ("prox", "ref", "values")
"""The learner's forward-only calls: each stores a per-token key on every :class:`Sequence` of its
role's share (``prox_logp``, ``ref_logp``, ``values``), the only keys one role computes for
another."""


def role_layouts(
    placement: PlacementConfig, world: int, roles: tuple[str, ...]
) -> dict[str, tuple[tuple[int, ...], int]]:
    """Each of ``roles``' ranks (sorted) in a learner of ``world`` ranks (the ref's follow the
    actor's unless placed) and its tensor-parallel degree: what decides how a role splits the
    batch. Pure."""
    return {
        role: (
            tuple(sorted(placement.ranks_of(role, world))),
            getattr(placement, role).tensor_parallel,
        )
        for role in roles
    }


def exchanges(
    flow: Dataflow, layouts: dict[str, tuple], driver: tuple | None
) -> dict[str, tuple[str, ...]]:
    """Before which call (by name) which keys must cross the global group: a key one of the
    learner's forward-only calls produces is exchanged before its first reader whose sequences are
    split otherwise (another ``layouts`` entry: a role's ranks and tensor-parallel degree). The
    driver's calls read the actor's shares when ``driver`` is the actor's layout, else (None) the
    whole batch on every rank. Empty when every role has the actor's layout. Pure."""
    producer = {k: c for c in flow.calls for k in c.outputs if c.name in LEARNER_INFERENCE}
    out: dict[str, tuple[str, ...]] = {}
    sent: set[str] = set()
    for level in flow.order():
        for c in level:
            where = layouts.get(c.role, driver)
            keys = tuple(
                k
                for k in c.inputs
                if k in producer and k not in sent and layouts[producer[k].role] != where
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
    layout: tuple[tuple[int, ...], int]  # (ranks, tensor-parallel degree): how it splits data
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

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """This rank's data-parallel group in the role (the ranks of one tensor-parallel group see
        the same sequences: the role's sums are reduced over this group alone)."""
        return self.parallel_dims.get_mesh("fsdp").get_group()

    @property
    def tp_rank(self) -> int:
        """This rank's place in its tensor-parallel group (0 without tensor parallelism)."""
        tp = self.parallel_dims.get_optional_mesh("tp")
        return tp.get_local_rank() if tp is not None else 0

    def share(self, seqs: list[Sequence]) -> list[Sequence]:
        """This rank's sequences of the role: balanced by tokens over its data-parallel ranks (a
        tensor-parallel group's ranks share one); none off the role."""
        if not self.holds:
            return []
        dp = self.parallel_dims.get_mesh("fsdp")
        return split_over_ranks(seqs, dp.size())[dp.get_local_rank()]


def build_role_meshes(
    placement: PlacementConfig, world: int, rank: int, roles: tuple[str, ...]
) -> dict[str, RoleMesh]:
    """A mesh per role of ``roles`` (collective: every rank, the same roles). Roles with the same
    layout (ranks, tensor-parallel degree) share one mesh (and its process groups)."""
    by_layout: dict[tuple, RoleMesh] = {}
    out: dict[str, RoleMesh] = {}
    for role, layout in role_layouts(placement, world, roles).items():
        if layout not in by_layout:
            ranks = layout[0]
            parallelism = role_parallelism(placement, role)
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
                layout=layout,
                parallelism=parallelism,
                parallel_dims=dims,
                rank=rank,
                whole_world=len(ranks) == world,
            )
        out[role] = by_layout[layout]
    return out
