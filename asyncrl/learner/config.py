"""What the learner's training machinery reads of the recipe, gathered in one place.

:meth:`TrainerConfig.from_recipe` is the one place the Trainer and what it builds (:class:`Models`,
the :class:`~asyncrl.learner.build.Builder`, the step's :mod:`.calls` and :mod:`.passes`, the
critic, the reward model's steps, the checkpoints) read the recipe; they take this config, or their
part of it, as TorchTitan's components take their own config and its Trainer assembles them. So a
component's inputs are named in one dataclass, with the values derived from several sections (the
sampling temperature of log π, the collective timeout, the critic's folder) computed once.
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
    Checkpointing,
    DataConfig,
    Dtype,
    LoraConfig,
    PlacementConfig,
    Recipe,
    learner_roles,
)


@dataclass(frozen=True, kw_only=True)
class BuildConfig:
    """How a role's model and optimizer are built (:class:`~asyncrl.learner.build.Builder`)."""

    dtype: Dtype  # model.dtype: the parameters' (FSDP's mixed precision) and the exports'
    compile: bool
    activation_checkpointing: Checkpointing
    betas: tuple[float, ...]
    eps: float
    weight_decay: float
    warmup_steps: int  # in versions
    lr_schedule: str
    updates_per_version: int  # learner.minibatches × learner.epochs: the schedule counts updates
    versions: int  # run.steps
    lora: LoraConfig  # learner.lora: adapters on the actor (rank 0: none)
    seed: int  # run.seed: the adapters' initial A


@dataclass(frozen=True, kw_only=True)
class CheckpointPolicy:
    """When the learner writes DCP checkpoints and HF exports, and how many it keeps."""

    every: int  # learner.checkpoint_every (0: only at the end)
    asynchronous: bool
    keep: int
    export_every: int  # learner.export_every (0: at the end)


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
    lr: float
    critic_lr: float
    grad_clip: float
    epochs: int
    minibatches: int
    micro_batch_tokens: int
    logits_chunk_mb: float
    max_staleness: int
    overlong_filter: bool
    max_new_tokens: int  # the normaliser's fixed length (``seq_mean_token_sum_norm``)
    turn_discount: float
    build: BuildConfig
    checkpoints: CheckpointPolicy
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
            lr=lc.lr,
            critic_lr=r.critic.lr,
            grad_clip=lc.grad_clip,
            epochs=lc.epochs,
            minibatches=lc.minibatches,
            micro_batch_tokens=lc.micro_batch_tokens,
            logits_chunk_mb=lc.logits_chunk_mb,
            max_staleness=r.buffer.max_staleness,
            overlong_filter=r.buffer.overlong_filter,
            max_new_tokens=r.rollout.max_new_tokens,
            turn_discount=r.rollout.turn_discount,
            build=BuildConfig(
                dtype=r.model.dtype,
                compile=lc.compile,
                activation_checkpointing=lc.activation_checkpointing,
                betas=tuple(lc.betas),
                eps=lc.eps,
                weight_decay=lc.weight_decay,
                warmup_steps=lc.warmup_steps,
                lr_schedule=lc.lr_schedule,
                updates_per_version=lc.minibatches * lc.epochs,
                versions=r.run.steps,
                lora=lc.lora,
                seed=r.run.seed,
            ),
            checkpoints=CheckpointPolicy(
                every=lc.checkpoint_every,
                asynchronous=lc.checkpoint_async,
                keep=lc.keep_checkpoints,
                export_every=lc.export_every,
            ),
            held_out=HeldOutPairs(
                path=r.resolve(r.data.eval_path) if r.data.eval_path else None,
                limit=r.run.eval_prompts,
                every=r.run.eval_every,
                data=r.data,
            ),
        )
