"""One off-policy RL step (docs/off-policy.md) over the learner's models, on every rank with the
same batch: sequences → this rank's share → the learner's calls of the recipe's dataflow
(:mod:`.calls`), level by level: π_prox and π_ref (forward-only passes), the critic's values, the
advantages, then the train steps: for each epoch, for each mini-batch: micro-batches → logprobs at
the sampling temperature → loss normalised by the mini-batch's GLOBAL counts → backward →
``clip_grad_norm_`` → optimizer and scheduler step (then the critic's update on the same
micro-batches). The graph's generate and reward calls ran in the rollout workers: their outputs
are the batch. One version per batch, whatever the updates.

The statistics reduced at the end always have the same names and shapes on every rank, whatever
its share held, so the one collective that sums them pairs up. They are summed on the device,
micro-batch after micro-batch (:class:`~asyncrl.learner.passes.StepTotals`), and come to the host
once a step, after that collective (:func:`sum_over_ranks`).
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from asyncrl import metric_names as names
from asyncrl.learner import cpu_shims
from asyncrl.learner.calls import CALL_RUNNERS, Step, exchange
from asyncrl.learner.critic import critic_zero_stats
from asyncrl.learner.drift import finalize_drift
from asyncrl.learner.losses.staleness_stats import (
    COLUMNS,
    finalize_staleness,
    reward_by_staleness,
)
from asyncrl.learner.losses.stats import finalize_stats
from asyncrl.learner.models import LearnerError, Models
from asyncrl.learner.offload import Reallocation
from asyncrl.learner.packing import Sequence, make_sequence
from asyncrl.learner.passes import StepTotals
from asyncrl.learner.routing import agreement
from asyncrl.learner.source import Batch
from asyncrl.moe import route_problem
from asyncrl.rollout.turns import turn_of


def peak_memory() -> dict[str, float]:
    """This process's high-water marks so far: resident memory (Linux reports KiB), and on a GPU
    the most the caching allocator ever handed out."""
    out = {"learner/max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if not cpu_shims.ON_CPU:
        out["learner/device_max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


@dataclass(kw_only=True)
class StepResult:
    """What one optimizer step reports (identical on every rank)."""

    version: int
    loss: float
    metrics: dict[str, float]


def sequences(
    models: Models, batch: Batch, version: int
) -> tuple[list[Sequence], dict[str, float]]:
    """Every sample of the batch laid out for packing, in group order, with its reward (the
    ``advantages`` call sets the advantages), and the batch's numbers (staleness, truncation,
    reward and length means); refuses a token outside the staleness bound at ``version``."""
    c = models.config
    is_sft = c.loss == "sft"
    distill = c.algorithm.advantage == "distill" and not is_sft
    groups = [g for g in batch.groups if g.samples]
    rewards = [g.rewards for g in groups]
    seqs, i = [], 0
    eta = c.max_staleness
    vocab = models.spec.model.vocab_size
    info = {"learner/truncated_samples": 0.0}
    staleness: list[np.ndarray] = []
    for gi, g in enumerate(groups):
        for si, s in enumerate(g.samples):
            mask = s.loss_mask
            if c.overlong_filter and s.finish_reason == "length":
                mask = np.zeros_like(mask)
            if not is_sft and (mask > 0).any():
                k = version - np.asarray(s.versions)[mask > 0]
                if k.max() > eta or k.min() < 0:
                    # Every rank sees the whole batch, so every rank refuses it alike.
                    raise LearnerError(
                        f"sample {s.id!r} has tokens of staleness {int(k.min())}..{int(k.max())}"
                        f" at version {version}, outside [0, buffer.max_staleness={eta}]"
                    )
                staleness.append(k)
                if distill and len(s.teacher_logprobs) != len(s.completion_ids):
                    raise LearnerError(
                        f"sample {s.id!r} has {len(s.teacher_logprobs)} teacher logprobs for "
                        f"{len(s.completion_ids)} tokens: algorithm.advantage distill trains on "
                        "the teacher's (a worker without rollout.teacher made it?)"
                    )
            ids = np.concatenate([s.prompt_ids, s.completion_ids])
            if ids.size and (ids.min() < 0 or ids.max() >= vocab):
                # refused here, not by the embedding (on CUDA a device-side assert ends the process)
                bad = int(ids.min() if ids.min() < 0 else ids.max())
                raise LearnerError(
                    f"sample {s.id!r}: token id {bad} outside the model's vocabulary [0, {vocab}) "
                    "(does the generator serve another model than model.path?)"
                )
            if np.size(s.routed_experts):
                bad = route_problem(np.asarray(s.routed_experts), models.routes)
                if bad is not None:  # refused here, not by a kernel: as token ids, above
                    raise LearnerError(f"sample {s.id!r}: routed_experts {bad}")
            cut = len(s.prompt_ids) + len(s.completion_ids) - 1 > models.max_seq_len
            if cut:
                info["learner/truncated_samples"] += 1
            seqs.append(
                make_sequence(
                    i,
                    s.prompt_ids,
                    s.completion_ids,
                    loss_mask=mask,
                    behavior_logprobs=s.behavior_logprobs,
                    versions=s.versions,
                    reward=float(rewards[gi][si]),
                    max_len=models.max_seq_len,
                    teacher_logprobs=s.teacher_logprobs,
                    routed_experts=s.routed_experts,
                )
            )
            # no end token: a critic's advantages bootstrap from the last value (critic.py). A
            # per-turn sample carries its trajectory's reason: only its last turn was cut.
            turn = turn_of(s)
            ends = turn is None or turn.turn == turn.turns - 1
            seqs[-1].truncated = cut or (ends and s.finish_reason == "length")
            i += 1
    episode_weights(groups, seqs)
    if staleness:
        k = np.concatenate(staleness)
        info["learner/staleness_mean"] = float(k.mean())
        info["learner/staleness_max"] = float(k.max())
    if seqs and not is_sft:  # the reward curve, one point per step (an SFT row has no reward)
        info[names.BATCH_REWARD_MEAN] = float(np.mean(np.concatenate(rewards)))
        lengths = [len(s.completion_ids) for g in groups for s in g.samples]
        info[names.BATCH_RESPONSE_LENGTH_MEAN] = float(np.mean(lengths))
        ages = [version - g.behavior_version for g in groups]
        info |= reward_by_staleness(ages, rewards, max_staleness=eta)
    return seqs, info


def episode_weights(groups: list, seqs: list[Sequence]) -> None:
    """Each per-turn sample's ``seq_weight``: its share of its episode's trained tokens in the
    batch, so that under the sequence-mean aggregations an episode weighs as one sequence
    (:func:`~asyncrl.learner.losses.aggregation.token_weights`); whole samples keep 1. ``seqs`` are
    the samples of ``groups`` in order."""
    samples = [(gi, s) for gi, g in enumerate(groups) for s in g.samples]
    episodes: dict[tuple[int, str], list[Sequence]] = {}
    for (gi, s), seq in zip(samples, seqs, strict=True):
        turn = turn_of(s)
        if turn is not None and (seq.mask > 0).any():
            episodes.setdefault((gi, turn.episode), []).append(seq)
    for turns in episodes.values():
        total = sum(float(seq.mask.sum()) for seq in turns)
        for seq in turns:
            seq.seq_weight = float(seq.mask.sum()) / total


def run_calls(models: Models, realloc: Reallocation, run: Step) -> None:
    """The dataflow's calls in dependency order; one level's calls are independent, and offloaded
    roles are reloaded around theirs."""
    for level in realloc.levels(models.flow.order()):
        for call in level:
            if call.name in models.exchanges:  # another role's outputs: every rank takes part
                exchange(models, run, models.exchanges[call.name])
            runner = CALL_RUNNERS[call.name]
            # None: ran in the rollout workers, its outputs are the batch. A model role's call
            # runs on its ranks only; roles on disjoint ranks thus run one level's calls at once.
            mesh = models.meshes.get(call.role)
            if runner is not None and (mesh is None or mesh.holds):
                runner(models, run)
            run.done.add(call.name)


def sum_over_ranks(
    values: dict[str, torch.Tensor], device: torch.device | None = None
) -> dict[str, torch.Tensor]:
    """Each named tensor summed over every rank, in one float64 collective on ``device`` (every rank
    passes the same names and shapes; host tensors among them go there first), and read back to
    the host in one copy: the step's one wait for the device."""
    keys = sorted(values)
    flat = torch.cat([values[k].to(device=device, dtype=torch.float64).reshape(-1) for k in keys])
    dist.all_reduce(flat)
    flat = flat.cpu()
    out, at = {}, 0
    for k in keys:
        n = values[k].numel()
        out[k] = flat[at : at + n].reshape(values[k].shape)
        at += n
    return out


def reduce_totals(models: Models, totals: StepTotals) -> dict[str, torch.Tensor]:
    """This step's totals summed over ranks, by name: ``counted/…`` the token sums (loss, tokens,
    the loss statistics ``counted/stat/…``, the drift), which a tensor-parallel group counts on its
    first rank alone (its ranks hold the same tokens); ``role/…`` a role's per-update numbers, the
    same on its ranks, from its first rank alone. The actor's gradient norms stay on the device
    (one per update: ``role/grad_norms``) until this one collective and read."""
    f64 = torch.float64
    c = models.config
    counted = {
        "loss": totals.loss.reshape(1),
        "tokens": torch.tensor([float(totals.tokens)], dtype=f64),
        "drift": totals.drift,
        "staleness": (
            torch.zeros(models.config.max_staleness + 1, len(COLUMNS), dtype=f64)
            if totals.staleness is None
            else totals.staleness  # read with the rest, in sum_over_ranks' one copy
        ),
    } | {f"stat/{k}": v.reshape(1) for k, v in totals.stats.items()}
    # the actor's routings that agreed with the generator's, and all with the generator's
    counted["routing"] = agreement(models.actor, reset=True)
    if c.algorithm.moe_aux_loss_coef > 0:  # every rank has the entry: the collective pairs up
        counted["moe_aux"] = (
            torch.zeros(1, dtype=f64) if totals.moe_aux is None else totals.moe_aux.reshape(1)
        )
    trained = [m for role, m in models.meshes.items() if role != "ref" and m.holds]
    if any(m.tp_rank != 0 for m in trained):
        counted = {k: torch.zeros_like(v, dtype=f64) for k, v in counted.items()}
    role = {k: torch.zeros(1, dtype=f64) for k in ("lr", "micro_batches", "critic_grad_norm")}
    updates = models.config.learner.minibatches * models.config.learner.epochs
    role["grad_norms"] = torch.zeros(updates, dtype=f64)
    if models.meshes["actor"].leader:
        role["grad_norms"] = torch.stack(totals.grad_norms).to(f64)
        role["lr"][0] = float(totals.lrs[0])
        role["micro_batches"][0] = float(totals.micro_batches)
    if models.config.learner.lr_ess_scale != "off":  # the same on every actor rank
        role["lr_ess_factor"] = torch.zeros(1, dtype=f64)
        if models.meshes["actor"].leader and totals.lr_factors:
            role["lr_ess_factor"][0] = float(np.mean(totals.lr_factors))
    critic = models.meshes.get("critic")
    if critic is not None and critic.leader and totals.critic_grad_norms:
        role["critic_grad_norm"] = torch.stack(totals.critic_grad_norms).to(f64).mean().reshape(1)
    named = {f"counted/{k}": v for k, v in counted.items()} | {
        f"role/{k}": v for k, v in role.items()
    }
    return sum_over_ranks(named, models.device)


def train_step(models: Models, realloc: Reallocation, batch: Batch, version: int) -> StepResult:
    """One batch from ``version``, one new version (collective; every rank passes the same batch).

    ``learner.epochs`` passes, each of ``learner.minibatches`` optimizer updates on a random
    part of the batch. With more than one update, π_prox (and the drift) come from a forward-only
    pass before the first; with one, from that update's own forward, which is the same thing.
    """
    t0 = time.perf_counter()
    c = models.config
    eta = c.max_staleness
    seqs, info = sequences(models, batch, version)
    totals = StepTotals.on(models.device, eta, c.algorithm.loss)
    if models.with_critic:
        totals.stats |= critic_zero_stats(models.device)
    run = Step(
        batch=batch,
        seqs=seqs,
        mine=models.meshes["actor"].share(seqs),
        shares={role: m.share(seqs) for role, m in models.meshes.items()},
        version=version,
        totals=totals,
        several=c.learner.minibatches * c.learner.epochs > 1,
    )
    agreement(models.actor, reset=True)  # count this step's forwards only
    run_calls(models, realloc, run)
    summed = reduce_totals(models, totals)
    metrics = step_metrics(models, summed, time.perf_counter() - t0, len(seqs), info | run.info)
    for k, v in batch.stats.items():
        if isinstance(v, int | float) and not isinstance(v, bool):
            metrics.setdefault(k if "/" in k else f"buffer/{k}", float(v))
    return StepResult(version=version + 1, loss=metrics[names.LOSS], metrics=metrics)


def step_metrics(
    models: Models, summed: dict[str, torch.Tensor], dt: float, seqs: int, info: dict[str, float]
) -> dict[str, float]:
    """The step's metrics from its reduced totals (``dt``: its seconds; ``info``: what the batch
    and the calls reported)."""
    c = models.config
    updates = c.learner.minibatches * c.learner.epochs
    tokens = float(summed["counted/tokens"])
    stats = {k.removeprefix("counted/stat/"): float(v) for k, v in summed.items() if "/stat/" in k}
    grad_norms = summed["role/grad_norms"].tolist()
    out = {
        names.LOSS: float(summed["counted/loss"]) / updates,
        names.GRAD_NORM: float(np.mean(grad_norms)),
        "lr": float(summed["role/lr"]),
        "learner/step_s": dt,
        names.TRAINED_TOKENS: tokens,
        names.TRAINED_TOKENS_PER_S: tokens / dt if dt > 0 else 0.0,
        "learner/micro_batches": float(summed["role/micro_batches"]),
        "learner/updates": float(updates),
        "learner/sequences": float(seqs),
    }
    if updates > 1:
        out["grad_norm/max"] = float(max(grad_norms))
    if "role/lr_ess_factor" in summed:  # the ESS scale (mean over the updates) and the lr it gave
        out["learner/lr_ess_factor"] = float(summed["role/lr_ess_factor"])
        out["learner/lr_effective"] = out["lr"] * out["learner/lr_ess_factor"]
    if models.with_critic:
        out[names.VALUE_LOSS] = stats.pop("value_loss") / updates
        out["critic/grad_norm"] = float(summed["role/critic_grad_norm"])
    agree, routed = summed["counted/routing"].tolist()
    if routed:  # samples carried the generator's routes (routing replay on or off)
        out[names.ROUTING_AGREEMENT] = agree / routed
    if "counted/moe_aux" in summed:  # the load-balancing loss, mean over the updates
        out[names.MOE_AUX] = float(summed["counted/moe_aux"]) / updates
    out |= peak_memory() | info | finalize_stats(stats)
    if models.config.loss != "sft":
        eta = models.config.max_staleness
        out |= finalize_drift(summed["counted/drift"].reshape(eta + 2, 3))
        out |= finalize_staleness(summed["counted/staleness"].reshape(eta + 1, len(COLUMNS)))
    return out
