"""The learner's passes over micro-batches: forward-only ones (log π, π_prox's recompute, π_ref's
and the critic's per-token values) and one optimizer update of the actor.

An update reduce-scatters its gradients at every micro-batch, as TorchTitan's trainer does: they
accumulate sharded, ``4·P/N`` bytes a rank (what :mod:`asyncrl.memory` prices). Turning gradient
sync off for all but the last micro-batch would save the collectives of the others but keep every
parameter's unsharded float32 gradient on every rank between them, ``4·P`` (FSDP2's
``unsharded_accumulated_grad``): +30 GiB a rank for Qwen3-8B. The critic's and the reward model's
updates accumulate the same way.

Every collective runs on every rank of a role with the same shapes, whatever the data: the
micro-batch count is agreed (empty rows pad) and a rank whose micro-batch trains no token still runs
the output projection on one row.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torchtitan.distributed import utils as dist_utils

from asyncrl.learner.attention import attention_masks
from asyncrl.learner.distill import distill
from asyncrl.learner.drift import drift_sums
from asyncrl.learner.logprobs import chunked_backward, chunked_logprobs, local_hidden
from asyncrl.learner.losses.aggregation import Normaliser, count_tokens_and_seqs
from asyncrl.learner.losses.policy import needs_prox, policy_loss
from asyncrl.learner.losses.stats import zero_stats
from asyncrl.learner.models import Models
from asyncrl.learner.packing import MicroBatch, Sequence, pack, split_micro_batches
from asyncrl.learner.placement import RoleMesh


@dataclass(kw_only=True)
class StepTotals:
    """What one step's updates add up on this rank, reduced over ranks at the step's end."""

    drift: torch.Tensor
    loss: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    tokens: int = 0
    stats: dict[str, torch.Tensor] = field(default_factory=zero_stats)
    grad_norms: list[float] = field(default_factory=list)
    critic_grad_norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    micro_batches: int = 0


def micro_batches(
    models: Models, mine: list[Sequence], group: dist.ProcessGroup | None = None
) -> list[MicroBatch]:
    """This rank's sequences, packed; every rank of the role (``group``, default every rank)
    runs the same number of micro-batches (FSDP's collectives must pair up), padding with empty
    rows that carry no loss."""
    bins = split_micro_batches(mine, models.config.learner.micro_batch_tokens)
    n = torch.tensor([len(bins)], dtype=torch.int64)
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
    bins += [[] for _ in range(int(n) - len(bins))]
    return [pack(b).to(models.device) for b in bins]


def hidden(models: Models, mb: MicroBatch, model: torch.nn.Module) -> torch.Tensor:
    """The last hidden states ``[1, L, D]``: the models stop before their output projection,
    which runs a chunk of trained tokens at a time (:mod:`asyncrl.learner.logprobs`). A plain
    tensor, also under tensor parallelism (:func:`local_hidden`)."""
    mb = mb.to(models.device)
    return local_hidden(model(mb.tokens, mb.positions, attention_masks(model, mb.positions)))


@torch.no_grad()
def token_logprobs(
    models: Models, mb: MicroBatch, model: torch.nn.Module | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """log π and entropy of each trained token of ``mb`` (flat over ``mb.sel``), no gradient;
    ``model`` defaults to the actor."""
    model = models.actor if model is None else model
    assert model is not None
    h = hidden(models, mb, model)
    return chunked_logprobs(
        h[0, mb.sel],
        mb.labels[0, mb.sel],
        model.lm_head,
        temperature=models.temperature,
        chunk=models.chunk_tokens,
    )


def logprobs(models: Models, mbs: list[MicroBatch]) -> list[torch.Tensor]:
    """Forward only: log π of each micro-batch's trained tokens with the current weights, at the
    sampling temperature (generators report log_softmax(logits / T): docs/off-policy.md)."""
    return [token_logprobs(models, mb)[0] for mb in mbs]


def drift(models: Models, mb: MicroBatch, prox_logp: torch.Tensor, version: int) -> torch.Tensor:
    """This micro-batch's drift sums (:func:`drift_sums`) against π_prox, at ``version``."""
    cpu = (t.cpu() for t in (mb.behavior_logp, prox_logp, version - mb.versions, mb.mask))
    return drift_sums(*cpu, mb.mixed_versions.cpu(), max_staleness=models.config.max_staleness)


def per_token(
    models: Models,
    mine: list[Sequence],
    compute: Callable[[MicroBatch], dict[str, torch.Tensor]],
    group: dist.ProcessGroup | None = None,
) -> None:
    """A forward-only pass over this rank's sequences (collective over the role's ``group``):
    ``compute`` gives, per micro-batch, named values flat over its trained tokens, which are
    stored on each :class:`Sequence` as a per-position array of that name (0 off its trained
    tokens)."""
    by_index = {s.index: s for s in mine}
    for mb in micro_batches(models, mine, group):
        out = {k: v.float().cpu().numpy() for k, v in compute(mb).items()}
        sel = mb.sel.cpu().numpy()
        starts = np.cumsum([0] + [len(by_index[i]) for i in mb.seq_index])
        for j, i in enumerate(mb.seq_index):
            seq = by_index[i]
            at = (sel >= starts[j]) & (sel < starts[j + 1])
            for name, flat in out.items():
                arr = np.zeros(len(seq), np.float32)
                arr[sel[at] - starts[j]] = flat[at]
                setattr(seq, name, arr)


def recompute_prox(
    models: Models, mine: list[Sequence], version: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """π_prox before a batch's first update (AReaL's recompute): one forward-only pass over this
    rank's sequences, stored on each :class:`Sequence`; returns the batch's drift sums."""
    sums = torch.zeros(models.config.max_staleness + 2, 3, dtype=torch.float64)

    def prox(mb: MicroBatch) -> dict[str, torch.Tensor]:
        lp = token_logprobs(models, mb)[0]
        sums.add_(drift(models, mb, lp.float().cpu(), version))
        return {"prox_logp": lp}

    per_token(models, mine, prox, group)
    return sums


def normaliser(models: Models, mbs: list[MicroBatch], mesh: RoleMesh) -> Normaliser:
    """A mini-batch's GLOBAL token and sequence counts: every micro-batch of every
    data-parallel rank of the role (collective over them; a tensor-parallel group's ranks hold
    the same tokens: counted once)."""
    counts = sum(
        (count_tokens_and_seqs(mb.mask, mb.seq_ids, mb.seq_weights) for mb in mbs), torch.zeros(2)
    )
    counts = counts.to(torch.float64)
    dist.all_reduce(counts, group=mesh.dp_group)
    return Normaliser(
        tokens=float(counts[0]),
        seqs=float(counts[1]),
        seq_len=float(models.config.max_new_tokens),
    )


def advantages(models: Models, mb: MicroBatch, log_pi: torch.Tensor) -> torch.Tensor:
    """The advantages of ``mb``'s trained tokens in the update: the batch's, or with
    ``algorithm.advantage: distill`` log π_teacher − sg[log π] (+ ``distill_coef`` × the batch's
    per-sample outcome advantage), ``log_pi`` this update's own forward (:func:`distill`)."""
    alg = models.config.algorithm
    if alg.advantage != "distill" or alg.loss == "sft":
        return mb.advantages
    assert mb.teacher_logp is not None  # learner/step.py refuses a trained token without one
    a = distill(
        log_pi.detach()[None],
        mb.teacher_logp[None],
        mb.mask[None],
        outcome=mb.advantages[None],
        coef=alg.distill_coef,
    )
    return a[0]


def actor_micro_batch(
    models: Models,
    mb: MicroBatch,
    norm: Normaliser,
    totals: StepTotals,
    *,
    version: int,
    measure_drift: bool,
) -> None:
    """Forward and backward of one micro-batch's share of an update's loss.

    The loss is computed on log π (and the entropy) as leaves; its gradient then goes back
    through the output projection a chunk at a time and through the decoder
    (:mod:`asyncrl.learner.logprobs`). A rank whose micro-batch trains no token runs the same
    collectives (the projection on one row, with gradient 0), so FSDP's pair up."""
    alg, actor = models.config.algorithm, models.actor
    assert actor is not None
    h = hidden(models, mb, actor)
    # the ``ref`` call's, computed here or on the ref's own ranks (then exchanged)
    ref_logp = mb.ref_logp if "ref" in models.meshes else None
    rows = mb.sel if mb.sel.numel() else torch.zeros(1, dtype=torch.long, device=h.device)
    hid, labels = h[0, rows], mb.labels[0, rows].clamp(min=0)
    chunking = {"temperature": models.temperature, "chunk": models.chunk_tokens}
    # Both passes run on every rank, in the same order: FSDP's state machine for the group that
    # holds the projection (and its reduce-scatter) must follow the same path everywhere.
    lp, ent = chunked_logprobs(hid, labels, actor.lm_head, **chunking)
    if mb.sel.numel() == 0:
        grad_logp, grad_ent = torch.zeros_like(lp), None
    else:
        logp = lp.requires_grad_(True)
        entropy = ent.requires_grad_(True) if alg.entropy_coef != 0 else ent
        prox = mb.prox_logp if mb.prox_logp is not None else logp.detach()
        loss, st = policy_loss(
            cfg=alg,
            norm=norm,
            logp=logp,
            mask=mb.mask,
            seq_ids=mb.seq_ids,
            behavior_logp=mb.behavior_logp,
            advantages=advantages(models, mb, logp),  # distill: the current π's (not π_prox)
            prox_logp=prox if needs_prox(alg.loss) else None,
            ref_logp=ref_logp,
            entropy=entropy,
            seq_weights=mb.seq_weights,
        )
        wrt = [logp, entropy] if entropy.requires_grad else [logp]
        grads = torch.autograd.grad(loss, wrt, allow_unused=True)
        grad_logp = torch.zeros_like(logp) if grads[0] is None else grads[0]
        grad_ent = None
        if len(grads) > 1:
            grad_ent = torch.zeros_like(entropy) if grads[1] is None else grads[1]
        for k, v in st.items():
            totals.stats[k] += v.cpu()
        if measure_drift and alg.loss != "sft":
            totals.drift += drift(models, mb, prox, version)
        totals.loss += loss.detach().to(torch.float64).cpu()
    totals.tokens += 0 if mb.is_empty else mb.num_tokens
    grad_hidden = chunked_backward(hid, labels, actor.lm_head, grad_logp, grad_ent, **chunking)
    hid.backward(grad_hidden)


def update_actor(
    models: Models, mine: list[Sequence], totals: StepTotals, *, version: int, measure_drift: bool
) -> tuple[list[MicroBatch], Normaliser]:
    """One optimizer update on this rank's share of a mini-batch (collective over the actor's
    ranks). The loss is normalised by the mini-batch's GLOBAL counts; π_prox is the recomputed
    one when the sequences carry it, else this forward's own (the step's starting weights, one
    update). Returns the micro-batches and normaliser (a critic on these ranks reuses them)."""
    mesh, actor = models.meshes["actor"], models.actor
    assert actor is not None and models.optimizers is not None
    assert models.lr_schedulers is not None
    mbs = micro_batches(models, mine, mesh.group)
    norm = normaliser(models, mbs, mesh)
    models.optimizers.zero_grad()
    for mb in mbs:
        actor_micro_batch(models, mb, norm, totals, version=version, measure_drift=measure_drift)
    clip = models.config.learner.grad_clip
    grad_norm = dist_utils.clip_grad_norm_(
        list(actor.parameters()), clip if clip > 0 else math.inf, foreach=True
    )
    totals.grad_norms.append(float(grad_norm))
    totals.lrs.append(models.lr_schedulers.schedulers[0].get_last_lr()[0])
    totals.micro_batches += len(mbs)
    models.optimizers.step()
    models.lr_schedulers.step()
    return mbs, norm
