"""The learner's models on one rank, and what running them needs: each role's mesh, the actor and its
optimizer, π_ref, the critic (its own optimizer inside), the model spec and the logits chunking.
The Trainer (:mod:`asyncrl.learner.trainer`) builds them, loads them and checkpoints them; the step
code (:mod:`.passes`, :mod:`.calls`, :mod:`.step`) takes them, not the Trainer, so it sits below it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.protocols.model_spec import ModelSpec

from asyncrl import dataflow
from asyncrl.learner import cpu_shims
from asyncrl.learner.config import TrainerConfig
from asyncrl.learner.critic import Critic
from asyncrl.learner.offload import Offloader, Reallocation
from asyncrl.learner.placement import RoleMesh
from asyncrl.moe import RouteShape

log = logging.getLogger("asyncrl.learner")


class LearnerError(RuntimeError):
    """A configuration or state the learner cannot run with (one-line message)."""


@dataclass(kw_only=True)
class Models:
    """What this rank holds of each role. A role this rank is not on is None (its optimizer too);
    ``ref`` is filled after the actor's weights load (it may be resharded from them)."""

    config: TrainerConfig  # what the step, the critic and the reward model read of the recipe
    device: torch.device
    meshes: dict[str, RoleMesh]
    # each call's outputs another role's ranks need (:func:`asyncrl.learner.placement.exchanges`)
    exchanges: dict[str, tuple[str, ...]]
    spec: ModelSpec
    routes: RouteShape | None  # the routes a sample may carry for this model (None: dense)
    temperature: float  # of log π: the sampling temperature (1 for sft)
    chunk_tokens: int  # trained tokens per chunk of the output projection
    actor: torch.nn.Module | None = None
    optimizers: OptimizersContainer | None = None
    lr_schedulers: LRSchedulersContainer | None = None
    critic: Critic | None = None
    ref: torch.nn.Module | None = None

    @property
    def flow(self) -> dataflow.Dataflow:
        return self.config.flow

    @property
    def max_seq_len(self) -> int:
        return self.spec.model.max_seq_len

    @property
    def with_critic(self) -> bool:
        """The recipe trains a critic (on this rank or elsewhere)."""
        return "critic" in self.meshes

    @property
    def colocated(self) -> bool:
        """Every role on every rank."""
        return all(m.whole_world for m in self.meshes.values())

    def critic_interleaved(self) -> bool:
        """The critic shares the actor's ranks: its updates follow the actor's (one level's two
        train steps, run in turn on the same ranks)."""
        critic = self.meshes.get("critic")
        return critic is not None and critic.ranks == self.meshes["actor"].ranks


def reallocation(models: Models) -> Reallocation:
    """The critic and the reference placed with ``offload: true`` give their device memory back
    between their calls (docs/placement.md). Not the actor: it is published, checkpointed and
    exported between steps. On CPU the device is host memory: nothing to free."""
    offloaders = {}
    roles = {"critic": models.critic, "ref": models.ref}
    for role in ("actor", "critic", "ref"):
        if not getattr(models.config.placement, role).offload:
            continue
        if cpu_shims.ON_CPU or roles.get(role) is None:
            why = (
                "on CPU the device is host memory"
                if cpu_shims.ON_CPU
                else "the actor is published and checkpointed between steps"
                if role == "actor"
                else f"no {role} model on this rank"
            )
            log.info("placement.%s.offload: %s: nothing is freed", role, why)
        elif role == "critic":
            c = models.critic
            assert c is not None
            offloaders[role] = Offloader(
                model=c.model, optimizers=list(c.optimizers), device=models.device
            )
        else:
            offloaders[role] = Offloader(model=models.ref, device=models.device)
    return Reallocation(offloaders=offloaders)
