"""What the learner's training machinery reads of the recipe, gathered in one place.

:meth:`TrainerConfig.from_recipe` is the one place the Trainer and what it builds (:class:`Models`,
the :class:`~asyncrl.learner.build.Builder`, the step's :mod:`.calls` and :mod:`.passes`, the
critic, the reward model's steps, the checkpoints) read the recipe; they take this config, or their
part of it, as TorchTitan's components take their own config and its Trainer assembles them. So a
component's inputs are named in one dataclass, with the values derived from several sections (the
sampling temperature of log π, the collective timeout, the critic's folder) computed once. A
section the learner alone reads is carried whole, not copied field by field (``learner``,
``critic``, ``algorithm``, ``placement``): each setting exists once, in the recipe's schema, and a
component reads it there (``c.learner.lr``, the Builder's ``c.learner.betas``, the checkpoints'
``learner.checkpoint_every``).
The process's edges (the buffer, the weights, logging, data and evaluation: :mod:`.main`) keep
reading the recipe.

Named ``TrainerConfig``, not ``LearnerConfig``: that is the recipe's ``learner:`` section
(:class:`asyncrl.recipe.LearnerConfig`), one of the sections this gathers from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from asyncrl import dataflow
from asyncrl.learner.distributed import collective_timeout_s
from asyncrl.recipe import (
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    Dtype,
    LearnerConfig,
    PlacementConfig,
    Recipe,
    learner_roles,
)


@dataclass(frozen=True, kw_only=True)
class BuildConfig:
    """How a role's model and optimizer are built (:class:`~asyncrl.learner.build.Builder`): the
    recipe's ``learner`` section (the optimizer, its schedule, compile, activation checkpointing,
    ``lora``: adapters on the actor) and what it reads of other sections."""

    learner: LearnerConfig
    dtype: Dtype  # model.dtype: the parameters' (FSDP's mixed precision) and the exports'
    versions: int  # run.steps
    seed: int  # run.seed: the adapters' initial A

    @property
    def updates_per_version(self) -> int:
        """learner.minibatches × learner.epochs: the schedule counts updates."""
        return self.learner.minibatches * self.learner.epochs


@dataclass(frozen=True, kw_only=True)
class HeldOutPairs:
    """A reward model's held-out preference pairs (``data.eval_path``), scored at ``every``."""

    path: Path | None  # None: no held-out pairs
    limit: int  # run.eval_prompts: the first this many (0: all)
    every: int  # run.eval_every
    data: DataConfig  # the keys the pairs are read by, and the chat template


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """The learner's inputs (:meth:`from_recipe`)."""

    model_dir: Path  # model.path, resolved
    critic_dir: Path  # critic.path (default model.path), resolved
    run_dir: Path
    resume: bool
    seed: int
    steps: int
    collective_timeout_s: float
    attention: str
    max_seq_len: int
    flow: dataflow.Dataflow
    roles: tuple[str, ...]  # the models the learner builds (:func:`asyncrl.recipe.learner_roles`)
    placement: PlacementConfig
    algorithm: AlgorithmConfig
    temperature: float  # of log π: rollout.logprob_temperature (1 for sft)
    learner: LearnerConfig  # lr, grad_clip, epochs, minibatches, micro-batches, checkpoints, lora
    critic: CriticConfig  # its lr (its folder, resolved: critic_dir)
    max_staleness: int
    overlong_filter: bool
    max_new_tokens: int  # the normaliser's fixed length (``seq_mean_token_sum_norm``)
    turn_discount: float
    build: BuildConfig
    held_out: HeldOutPairs

    @property
    def loss(self) -> str:
        return self.algorithm.loss

    @classmethod
    def from_recipe(cls, r: Recipe) -> TrainerConfig:
        lc, alg = r.learner, r.algorithm
        return cls(
            model_dir=r.resolve(r.model.path),
            critic_dir=r.resolve(r.critic.path or r.model.path),
            run_dir=r.run_dir,
            resume=r.run.resume,
            seed=r.run.seed,
            steps=r.run.steps,
            collective_timeout_s=collective_timeout_s(r),
            attention=r.model.attention,
            max_seq_len=r.model.max_seq_len,
            flow=dataflow.from_recipe(r),
            roles=learner_roles(r),
            placement=r.placement,
            algorithm=alg,
            temperature=1.0 if alg.loss == "sft" else r.rollout.logprob_temperature,
            learner=lc,
            critic=r.critic,
            max_staleness=r.buffer.max_staleness,
            overlong_filter=r.buffer.overlong_filter,
            max_new_tokens=r.rollout.max_new_tokens,
            turn_discount=r.rollout.turn_discount,
            build=BuildConfig(
                learner=lc, dtype=r.model.dtype, versions=r.run.steps, seed=r.run.seed
            ),
            held_out=HeldOutPairs(
                path=r.resolve(r.data.eval_path) if r.data.eval_path else None,
                limit=r.run.eval_prompts,
                every=r.run.eval_every,
                data=r.data,
            ),
        )
