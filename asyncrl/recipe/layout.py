"""The rules a learner's layout obeys (docs/placement.md): which model roles a run builds
(:func:`learner_roles`), that each role's ranks exist, split into its tensor-parallel groups and
either equal another role's or do not meet them (:func:`check_placement`), that a critic on the
actor's ranks shares its tensor parallelism (:func:`check_critic_placement`), and when π_ref is
the LoRA actor's own base (:func:`ref_is_lora_base`).

asyncrl/learner/placement.py builds the meshes that obey them, and the learner checks them again
with its world size; they live here, under the recipe, because :func:`asyncrl.recipe.checks.validate`
applies them when a recipe loads (without the world), and the recipe (floor 1 of
tests/test_import_graph.py) cannot import the learner (floor 7). Only the recipe's own types are
read, so `asyncrl check`, the memory plan and the launcher apply them without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.recipe.fields import TOKEN_ADVANTAGES, RecipeError
from asyncrl.recipe.learner_sections import ROLES, LoraConfig, PlacementConfig, RolePlacement

if TYPE_CHECKING:
    from asyncrl.recipe.schema import Recipe


def learner_roles(r: Recipe) -> tuple[str, ...]:
    """The models the learner builds: the actor; a critic for a token-level advantage; π_ref for a
    KL term (on the loss or on the rewards)."""
    alg = r.algorithm
    critic = alg.uses_rollouts and alg.advantage in TOKEN_ADVANTAGES
    ref = alg.kl_coef > 0 or alg.kl_reward_coef > 0
    return ("actor",) + ("critic",) * critic + ("ref",) * ref


def check_placement(
    placement: PlacementConfig,
    world: int | None = None,
    *,
    file: str | None = None,
    roles: tuple[str, ...] = ROLES,
) -> None:
    """Each role's ranks exist (when ``world`` is known), are distinct, split evenly into its
    tensor-parallel degree, and either equal another role's ranks or do not meet them; the actor's
    include rank 0, which runs the buffer client and the weight broadcaster. ``roles``: the ones
    the run uses (the learner's, :func:`learner_roles`; a role it does not build meets no other)."""
    sets: dict[str, frozenset[int]] = {}
    for role in roles:
        rp: RolePlacement = getattr(placement, role)
        key = f"placement.{role}"
        if any(k < 0 for k in rp.ranks) or len(set(rp.ranks)) != len(rp.ranks):
            raise RecipeError(
                f"expected distinct ranks >= 0, got {rp.ranks}", file=file, key=f"{key}.ranks"
            )
        if role == "actor" and rp.ranks and 0 not in rp.ranks:
            raise RecipeError(
                "rank 0 runs the buffer client and the weight broadcaster, so the actor's ranks "
                f"must include it, got {rp.ranks}",
                file=file,
                key=f"{key}.ranks",
            )
        if world is not None and any(k >= world for k in rp.ranks):
            raise RecipeError(
                f"the learner has {world} rank(s) (0..{world - 1}), got {rp.ranks}",
                file=file,
                key=f"{key}.ranks",
            )
        n = len(rp.ranks) if rp.ranks else world
        if n is not None and n % rp.tensor_parallel:
            raise RecipeError(
                f"{n} rank(s) do not split into tensor-parallel groups of {rp.tensor_parallel}",
                file=file,
                key=f"{key}.tensor_parallel",
            )
        if world is not None:
            sets[role] = frozenset(placement.ranks_of(role, world))
        elif rp.ranks:
            sets[role] = frozenset(rp.ranks)
    for i, a in enumerate(roles):
        for b in roles[i + 1 :]:
            if a in sets and b in sets and sets[a] != sets[b] and sets[a] & sets[b]:
                raise RecipeError(
                    f"shares ranks {sorted(sets[a] & sets[b])} with placement.{a} but not all: "
                    "two roles run on the same ranks or on disjoint ones",
                    file=file,
                    key=f"placement.{b}.ranks",
                )


def check_critic_placement(
    placement: PlacementConfig, world: int | None = None, *, file: str | None = None
) -> None:
    """A critic on the actor's ranks has the actor's tensor-parallel degree: it trains on the
    actor's micro-batches, so each rank's data share must be the actor's. (Only where the run has
    a critic: :func:`learner_roles`.)"""
    actor, critic = placement.actor, placement.critic
    if critic.tensor_parallel == actor.tensor_parallel:
        return
    if world is not None:
        same = set(placement.ranks_of("critic", world)) == set(placement.ranks_of("actor", world))
    else:  # both unset: every rank; one set and not the other: known only with the world
        same = set(critic.ranks) == set(actor.ranks)
    if same:
        raise RecipeError(
            f"{critic.tensor_parallel} differs from placement.actor.tensor_parallel "
            f"{actor.tensor_parallel} on the same ranks: the critic trains on the actor's "
            "micro-batches, so each rank's data share must be the actor's",
            file=file,
            key="placement.critic.tensor_parallel",
        )


def ref_is_lora_base(placement: PlacementConfig, lora: LoraConfig, world: int) -> bool:
    """Whether π_ref is the LoRA actor's frozen base, its adapters off in the ``ref`` call, with no
    model of its own: adapters on, and the reference laid out as the actor (its ranks, its tensor
    parallelism) and not offloaded (docs/lora.md)."""
    a, ref = placement.actor, placement.ref
    return (
        lora.enabled
        and not ref.offload
        and ref.tensor_parallel == a.tensor_parallel
        and placement.ranks_of("ref", world) == placement.ranks_of("actor", world)
    )
