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

Nothing in a micro-batch's update is read back to the host: what the step needs as numbers comes
from packing (:class:`MicroBatch`), and the totals (loss, statistics, drift, gradient norms) stay
on the device until the step's end reads them all at once (:func:`asyncrl.learner.step.reduce_totals`;
tests/learner/test_device_tier.py counts the reads). A forward-only pass brings each micro-batch's
per-token results to the host once, to store them on the sequences.
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
from asyncrl.learner.losses.aggregation import Normaliser
from asyncrl.learner.losses.policy import needs_prox, policy_loss
from asyncrl.learner.losses.staleness_stats import BY_STALENESS
from asyncrl.learner.losses.stats import zero_stats
from asyncrl.learner.models import Models
from asyncrl.learner.packing import MicroBatch, Sequence, pack, split_micro_batches
from asyncrl.learner.placement import RoleMesh
from asyncrl.learner.routing import record_routing, recorded_aux_loss, set_routes


@dataclass(kw_only=True)
class StepTotals:
    """What one step's updates add up on this rank, reduced over ranks at the step's end. The
    tensors live on the model's device (:meth:`on`) and are added to there, micro-batch after
    micro-batch, with no read back to the host; the step's end reads them once."""

    drift: torch.Tensor
    loss: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    tokens: int = 0
    stats: dict[str, torch.Tensor] = field(default_factory=zero_stats)
    # the staleness view's sums, on the device, summed over micro-batches (None: none trained yet)
    staleness: torch.Tensor | None = None
    grad_norms: list[torch.Tensor] = field(default_factory=list)  # the actor's, one per update
    critic_grad_norms: list[torch.Tensor] = field(default_factory=list)  # the critic's, on device
    lrs: list[float] = field(default_factory=list)
    lr_factors: list[float] = field(default_factory=list)  # learner.lr_ess_scale's, per update
    micro_batches: int = 0
    # Σ over updates of the MoE load-balancing loss (its share on this rank; None: none computed)
    moe_aux: torch.Tensor | None = None

    @classmethod
    def on(cls, device: torch.device, max_staleness: int, loss: str = "") -> StepTotals:
        """Zero totals on ``device``: drift rows for staleness 0…η and kv_mixed, and the stats
        ``loss`` returns (m2po's carry its masked count too)."""
        f64 = torch.float64
        return cls(
            drift=torch.zeros(max_staleness + 2, 3, dtype=f64, device=device),
            loss=torch.zeros((), dtype=f64, device=device),
            stats=zero_stats(loss, device=device),
        )


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
    set_routes(model, mb.routes, replay=models.config.algorithm.routing_replay)
    masks = attention_masks(model, mb.positions, mb.doc_lengths)
    return local_hidden(model(mb.tokens, mb.positions, masks))


@torch.no_grad()
def token_logprobs(
    models: Models, mb: MicroBatch, model: torch.nn.Module | None = None, *, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π of each trained token of ``mb`` (flat over ``mb.sel``), no gradient, and with
    ``entropy`` its entropy (else None: a forward-only pass needs none, and it costs a softmax
    over the vocabulary per token); ``model`` defaults to the actor."""
    model = models.actor if model is None else model
    assert model is not None
    h = hidden(models, mb, model)
    return chunked_logprobs(
        h[0, mb.sel],
        mb.labels[0, mb.sel],
        model.lm_head,
        temperature=models.temperature,
        chunk=models.chunk_tokens,
        entropy=entropy,
    )


def logprobs(models: Models, mbs: list[MicroBatch]) -> list[torch.Tensor]:
    """Forward only: log π of each micro-batch's trained tokens with the current weights, at the
    sampling temperature (generators report log_softmax(logits / T): docs/off-policy.md)."""
    return [token_logprobs(models, mb)[0] for mb in mbs]


def drift(models: Models, mb: MicroBatch, prox_logp: torch.Tensor, version: int) -> torch.Tensor:
    """This micro-batch's drift sums (:func:`drift_sums`) against π_prox, at ``version``, on the
    device. The staleness bound was checked on the host (:func:`asyncrl.learner.step.sequences`)."""
    return drift_sums(
        mb.behavior_logp,
        prox_logp,
        version - mb.versions,
        mb.mask,
        mb.mixed_versions,
        max_staleness=models.config.max_staleness,
        checked=True,
    )


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
        sel = mb.sel_host
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
    f64 = torch.float64
    sums = torch.zeros(models.config.max_staleness + 2, 3, dtype=f64, device=models.device)

    def prox(mb: MicroBatch) -> dict[str, torch.Tensor]:
        lp = token_logprobs(models, mb)[0]
        sums.add_(drift(models, mb, lp.float(), version))
        return {"prox_logp": lp}

    per_token(models, mine, prox, group)
    return sums


def normaliser(models: Models, mbs: list[MicroBatch], mesh: RoleMesh) -> Normaliser:
    """A mini-batch's GLOBAL token and sequence counts: every micro-batch of every
    data-parallel rank of the role (collective over them; a tensor-parallel group's ranks hold
    the same tokens: counted once). The counts come from packing, on the host: a CPU tensor's
    all-reduce (gloo beside NCCL on a GPU), nothing read back from the device. With the MoE
    load-balancing loss on, the same collective counts every input position too (its mean's
    denominator); off, it is the two counts alone."""
    tokens, seqs = 0.0, 0.0
    for mb in mbs:
        tokens += mb.trained_tokens
        seqs += mb.trained_seqs
    counted = [tokens, seqs]
    if models.config.algorithm.moe_aux_loss_coef > 0:
        counted.append(float(sum(0 if mb.is_empty else mb.num_tokens for mb in mbs)))
    counts = torch.tensor(counted, dtype=torch.float64)
    dist.all_reduce(counts, group=mesh.dp_group)
    tokens, seqs, *positions = counts.tolist()
    return Normaliser(
        tokens=tokens,
        seqs=seqs,
        seq_len=float(models.config.max_new_tokens),
        positions=positions[0] if positions else 0.0,
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
    m2po_cut: float = math.inf,
) -> None:
    """Forward and backward of one micro-batch's share of an update's loss.

    The loss is computed on log π (and the entropy) as leaves; its gradient then goes back
    through the output projection a chunk at a time and through the decoder
    (:mod:`asyncrl.learner.logprobs`). A rank whose micro-batch trains no token runs the same
    collectives (the projection on one row, with gradient 0), so FSDP's pair up.

    With ``moe_aux_loss_coef`` > 0 on an MoE, the routers record this forward, and coef × the
    load-balancing loss of the micro-batch's tokens, weighted by their share of the mini-batch's
    positions (so the update's term is the token-weighted mean over its micro-batches), goes back
    in the same backward as the policy loss's gradient. An empty micro-batch (the padding row)
    adds none."""
    alg, actor = models.config.algorithm, models.actor
    assert actor is not None
    recording = record_routing(actor) if alg.moe_aux_loss_coef > 0 else []
    h = hidden(models, mb, actor)
    aux = recorded_aux_loss(recording) if recording else None
    # the ``ref`` call's, computed here or on the ref's own ranks (then exchanged)
    ref_logp = mb.ref_logp if "ref" in models.meshes else None
    rows = mb.sel if mb.sel.numel() else torch.zeros(1, dtype=torch.long, device=h.device)
    hid, labels = h[0, rows], mb.labels[0, rows].clamp(min=0)
    chunking = {"temperature": models.temperature, "chunk": models.chunk_tokens}
    # Both passes run on every rank, in the same order: FSDP's state machine for the group that
    # holds the projection (and its reduce-scatter) must follow the same path everywhere.
    # the entropy: for its gradient (entropy_coef) and for its logged metric (loss/entropy)
    lp, ent = chunked_logprobs(hid, labels, actor.lm_head, entropy=True, **chunking)
    assert ent is not None
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
            staleness=version - mb.versions if alg.prox_anchor == "staleness" else None,
            m2po_cut=m2po_cut,
            token_staleness=version - mb.versions,
            max_staleness=models.config.max_staleness,
        )
        by_k = st.pop(BY_STALENESS, None)
        if by_k is not None:
            totals.staleness = by_k if totals.staleness is None else totals.staleness + by_k
        wrt = [logp, entropy] if entropy.requires_grad else [logp]
        grads = torch.autograd.grad(loss, wrt, allow_unused=True)
        grad_logp = torch.zeros_like(logp) if grads[0] is None else grads[0]
        grad_ent = None
        if len(grads) > 1:
            grad_ent = torch.zeros_like(entropy) if grads[1] is None else grads[1]
        for k, v in st.items():
            totals.stats[k] += v
        if measure_drift and alg.loss != "sft":
            totals.drift += drift(models, mb, prox, version)
        totals.loss += loss.detach().to(torch.float64)
    totals.tokens += 0 if mb.is_empty else mb.num_tokens
    grad_hidden = chunked_backward(hid, labels, actor.lm_head, grad_logp, grad_ent, **chunking)
    if aux is None or mb.is_empty:
        hid.backward(grad_hidden)
        return
    share = mb.num_tokens / norm.positions
    torch.autograd.backward([hid, aux * (alg.moe_aux_loss_coef * share)], [grad_hidden, None])
    part = aux.detach().to(torch.float64) * share
    totals.moe_aux = part if totals.moe_aux is None else totals.moe_aux + part


def update_actor(
    models: Models,
    mine: list[Sequence],
    totals: StepTotals,
    *,
    version: int,
    measure_drift: bool,
    m2po_cut: float = math.inf,
) -> tuple[list[MicroBatch], Normaliser]:
    """One optimizer update on this rank's share of a mini-batch (collective over the actor's
    ranks). The loss is normalised by the mini-batch's GLOBAL counts; π_prox is the recomputed
    one when the sequences carry it, else this forward's own (the step's starting weights, one
    update). With ``learner.lr_ess_scale`` the update's lr is the schedule's times
    :func:`ess_lr_factor` of the mini-batch's importance weights. Returns the micro-batches and
    normaliser (a critic on these ranks reuses them)."""
    mesh, actor = models.meshes["actor"], models.actor
    assert actor is not None and models.optimizers is not None
    assert models.lr_schedulers is not None
    mbs = micro_batches(models, mine, mesh.group)
    norm = normaliser(models, mbs, mesh)
    models.optimizers.zero_grad()
    lc = models.config.learner
    before = {k: totals.stats[k].clone() for k in ESS_KEYS} if lc.lr_ess_scale != "off" else {}
    for mb in mbs:
        actor_micro_batch(
            models,
            mb,
            norm,
            totals,
            version=version,
            measure_drift=measure_drift,
            m2po_cut=m2po_cut,
        )
    clip = models.config.learner.grad_clip
    grad_norm = dist_utils.clip_grad_norm_(
        list(actor.parameters()), clip if clip > 0 else math.inf, foreach=True
    )
    totals.grad_norms.append(grad_norm.detach())
    totals.lrs.append(models.lr_schedulers.schedulers[0].get_last_lr()[0])
    totals.micro_batches += len(mbs)
    if lc.lr_ess_scale == "off":
        models.optimizers.step()
    else:
        sums = torch.stack([totals.stats[k] - before[k] for k in ESS_KEYS]).to(torch.float64)
        dist.all_reduce(sums, group=mesh.dp_group)
        factor = ess_lr_factor(*(float(x) for x in sums), lc.lr_ess_scale, lc.lr_ess_floor)
        totals.lr_factors.append(factor)
        groups = [g for opt in models.optimizers for g in opt.param_groups]
        lrs = [g["lr"] for g in groups]
        for g in groups:
            g["lr"] = g["lr"] * factor
        models.optimizers.step()
        for g, lr in zip(groups, lrs, strict=True):  # the schedule goes on from its own lr
            g["lr"] = lr
    models.lr_schedulers.step()
    return mbs, norm


ESS_KEYS = ("tokens", "is_weight", "is_weight_sq")
"""The loss statistics an update's importance-weight ESS is made of."""


def ess_lr_factor(tokens: float, w: float, w_sq: float, rule: str, floor: float) -> float:
    """VCPO's step scale (arXiv 2602.17616): the normalised ESS = (Σw)² / (N·Σw²) ∈ (0, 1] of
    the update's importance weights w = ρ (the ones :func:`policy_loss` logs as ``loss/ess``),
    raised to ½ (``sqrt``: ESS·N is the effective batch, and Adam's lr scales with the square root
    of the batch, VCPO's rule) or 1 (``linear``), and at least ``floor``. No tokens: 1."""
    ess = w * w / (tokens * w_sq) if tokens > 0 and w_sq > 0 else 1.0
    ess = min(max(ess, 0.0), 1.0)
    return max(floor, math.sqrt(ess) if rule == "sqrt" else ess)
