"""The learner's calls of the recipe's dataflow (:mod:`asyncrl.dataflow`): one function per call
name (:data:`CALL_RUNNERS`), each run on its role's ranks over one step's :class:`Step`, and the
exchange that brings another role's outputs to every rank before a call that needs them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from asyncrl import metric_names as names
from asyncrl.learner import distill, lora, passes
from asyncrl.learner.advantages import compute_advantages
from asyncrl.learner.config import TrainerConfig
from asyncrl.learner.critic import assign_targets
from asyncrl.learner.losses.policy import m2po_threshold
from asyncrl.learner.models import Models
from asyncrl.learner.packing import Sequence, split_minibatches
from asyncrl.learner.passes import StepTotals
from asyncrl.learner.source import Batch
from asyncrl.rollout.turns import turn_of


@dataclass(kw_only=True)
class Step:
    """One step's data as its calls run: the batch, its sequences and this rank's shares of them,
    the version the step starts from, the running totals, what the calls reported, and which calls
    have run."""

    batch: Batch
    seqs: list[Sequence]
    mine: list[Sequence]  # this rank's share when split over every rank
    shares: dict[str, list[Sequence]]  # each role's share on this rank (none off its ranks)
    version: int
    totals: StepTotals
    several: bool  # more than one update per batch
    m2po_cut: float = math.inf  # m2po: the batch's second-moment cut (call_prox sets it)
    info: dict[str, float] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)

    def share(self, role: str) -> list[Sequence]:
        return self.shares[role]


def minibatches(models: Models, mine: list[Sequence], version: int) -> list[list[Sequence]]:
    """``learner.epochs`` passes over this rank's share of a role, each in ``learner.minibatches``
    random parts (the same seeds for actor and critic), in update order."""
    c = models.config
    return [
        part
        for epoch in range(c.learner.epochs)
        for part in split_minibatches(mine, c.learner.minibatches, seed=(c.seed, version, epoch))
    ]


def group_advantages(config: TrainerConfig, batch: Batch, seqs: list[Sequence]) -> dict[str, float]:
    """Each sequence's advantage from its group's rewards (``algorithm.advantage``); ``seqs`` are
    the sequences of ``batch`` (:func:`asyncrl.learner.step.sequences`). Per-turn samples
    (``rollout.turn_samples``) are found by the place each carries (``turn_of``): the group's
    baseline is over episodes. Returns the batch's ReMax count."""
    alg = config.algorithm
    groups = [g for g in batch.groups if g.samples]
    if not groups:
        return {}
    baselines = [g.baseline_reward for g in groups]
    advs = compute_advantages(
        [g.rewards for g in groups],
        kind=alg.advantage,
        eps=alg.adv_eps,
        baselines=baselines,
        turns=[[turn_of(s) for s in g.samples] for g in groups],
        turn_discount=config.turn_discount,
    )
    for seq, a in zip(seqs, torch.cat(advs).tolist(), strict=True):
        seq.advantage = a
    if alg.advantage != "remax":
        return {}
    # groups whose greedy episode failed: their baseline is their own mean reward
    return {names.REMAX_MEAN_BASELINES: float(baselines.count(None))}


def distill_advantages(
    config: TrainerConfig, batch: Batch, seqs: list[Sequence]
) -> dict[str, float]:
    """``algorithm.advantage: distill``: with ``distill_coef`` > 0 each sequence's GRPO advantage of
    the group rewards (the outcome part); the teacher's part, log π_teacher − sg[log π] per token,
    is added in the update's forward, where log π is (:func:`asyncrl.learner.passes.advantages`).
    Returns the batch's reverse KL to the teacher (:func:`asyncrl.learner.distill.reverse_kl`)."""
    alg = config.algorithm
    if alg.distill_coef > 0:
        grpo = dataclasses.replace(alg, advantage="grpo")
        group_advantages(dataclasses.replace(config, algorithm=grpo), batch, seqs)
    return distill.reverse_kl(seqs)


def exchange(models: Models, run: Step, keys: tuple[str, ...]) -> None:
    """Every rank gets every sequence's ``keys`` (per-token float32 arrays), each computed on
    its producing role's ranks: one float32 sum over the global group (a CPU tensor: gloo), to
    which the first rank of each tensor-parallel group that computed a sequence writes its
    arrays and a presence mark, every other rank zeros. Tensors, not pickled objects: ranks may
    sit on other hosts."""
    role_of = {k: c.role for c in models.flow.calls for k in c.outputs}
    ends = np.cumsum([0] + [len(s) for s in run.seqs])
    total, n = int(ends[-1]), len(run.seqs)
    pos = {s.index: j for j, s in enumerate(run.seqs)}
    buf = np.zeros((len(keys), total + n), np.float32)  # each key: its arrays, then presence
    for a, k in enumerate(keys):
        mesh = models.meshes[role_of[k]]
        if not mesh.holds or mesh.tp_rank != 0:
            continue
        for s in run.share(role_of[k]):
            arr = getattr(s, k)
            if arr is not None:
                j = pos[s.index]
                buf[a, ends[j] : ends[j + 1]] = arr
                buf[a, total + j] = 1.0
    summed = torch.from_numpy(buf)
    dist.all_reduce(summed)
    buf = summed.numpy()
    for a, k in enumerate(keys):
        for j, s in enumerate(run.seqs):
            if buf[a, total + j] > 0:
                setattr(s, k, buf[a, ends[j] : ends[j + 1]].copy())


def call_prox(models: Models, run: Step) -> None:
    """``prox``: π_prox, the policy before the step's first update (several updates; V-trace's
    π). Its drift sums count when the updates do not measure the drift themselves."""
    group = models.meshes["actor"].group
    drift = passes.recompute_prox(models, run.share("actor"), run.version, group)
    if run.several:
        run.totals.drift += drift
    alg = models.config.algorithm
    if alg.loss == "m2po":  # the mask is cut once, over every data-parallel rank's tokens
        d2 = [
            (d * d)[s.mask > 0]
            for s in run.share("actor")
            if s.prox_logp is not None
            for d in [s.prox_logp - s.behavior_logp]
        ]
        flat = torch.from_numpy(np.concatenate(d2)) if d2 else torch.zeros(0)
        run.m2po_cut = m2po_threshold(flat, alg.m2po_tau, models.meshes["actor"].dp_group)


def call_ref(models: Models, run: Step) -> None:
    """``ref``: the frozen reference's logprobs (a KL term in the loss, or a KL reward). With
    LoRA π_ref may be the actor itself: its adapters are off here (:func:`lora.disabled`)."""
    ref = models.ref
    assert ref is not None
    with lora.disabled(ref):
        passes.per_token(
            models,
            run.share("ref"),
            lambda mb: {"ref_logp": passes.token_logprobs(models, mb, ref)[0]},
            models.meshes["ref"].group,
        )


def call_values(models: Models, run: Step) -> None:
    """``values``: the critic's V at every trained token."""
    critic = models.critic
    assert critic is not None
    group = models.meshes["critic"].group
    passes.per_token(models, run.share("critic"), lambda mb: {"values": critic.values(mb)}, group)


def call_advantages(models: Models, run: Step) -> None:
    """``advantages``: per token from the critic's values (whitened over the batch), per token
    from the teacher's logprobs (distill), or per sample from the group rewards of the whole batch
    (each rank computes the last two for all sequences alike).
    Roles on every rank: each rank its share, the whitening's sums reduced over them; roles on
    their own ranks: every rank all sequences (their values exchanged), no collective."""
    alg, colocated = models.config.algorithm, models.colocated
    if models.with_critic:
        seqs = run.mine if colocated else run.seqs
        group = models.meshes["actor"].dp_group if colocated else None
        run.info |= assign_targets(seqs, alg, reduce=colocated, group=group)
    elif alg.advantage == "distill":
        run.info |= distill_advantages(models.config, run.batch, run.seqs)
    else:
        run.info |= group_advantages(models.config, run.batch, run.seqs)


def call_train_actor(models: Models, run: Step) -> None:
    """``train_actor``: ``learner.epochs`` passes of ``learner.minibatches`` updates on the
    actor's ranks; with a critic on the same ranks, each update is followed by the critic's on
    the same micro-batches and normaliser (``train_critic``: the two train steps are
    independent calls of one level, interleaved per mini-batch on shared ranks)."""
    critic = models.critic
    interleaved = critic is not None and models.critic_interleaved()
    for part in minibatches(models, run.share("actor"), run.version):
        mbs, norm = passes.update_actor(
            models,
            part,
            run.totals,
            version=run.version,
            measure_drift=not run.several,
            m2po_cut=run.m2po_cut,
        )
        if interleaved:
            assert critic is not None
            run.totals.critic_grad_norms.append(critic.update(mbs, norm, run.totals.stats))


def call_train_critic(models: Models, run: Step) -> None:
    """``train_critic``: on the actor's ranks, done within :func:`call_train_actor`'s updates;
    on its own ranks, the same epochs and mini-batch draws over its share, while the actor's
    ranks train the actor."""
    critic = models.critic
    assert critic is not None
    if models.critic_interleaved():
        assert "train_actor" in run.done
        return
    mesh = models.meshes["critic"]
    for part in minibatches(models, run.share("critic"), run.version):
        mbs = passes.micro_batches(models, part, mesh.group)
        norm = passes.normaliser(models, mbs, mesh)
        run.totals.critic_grad_norms.append(critic.update(mbs, norm, run.totals.stats))


CallRunner = Callable[[Models, Step], None]

CALL_RUNNERS: dict[str, CallRunner | None] = {
    "generate": None,
    "generate_greedy": None,
    "reward_fn": None,
    "reward_fn_greedy": None,
    "reward": None,
    "reward_greedy": None,
    "teacher": None,
    "prox": call_prox,
    "ref": call_ref,
    "values": call_values,
    "advantages": call_advantages,
    "train_actor": call_train_actor,
    "train_critic": call_train_critic,
}
"""Each dataflow call (:mod:`asyncrl.dataflow`, by name) → the function that runs it, or None for
the calls of the rollout workers (generation, rewards), whose outputs arrive as the batch."""
