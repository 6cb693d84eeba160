"""How per-token losses add up to a step's loss, whatever the batch's split over ranks and
micro-batches.

Every tensor is 1-D over the completion tokens of one micro-batch (packed, no padding); ``seq_ids``
says which sequence each token belongs to and ``mask`` which tokens are trained on. A step's loss
(the policy's, :mod:`asyncrl.learner.losses.policy`; a critic's,
:mod:`asyncrl.learner.losses.scalar`) is a weighted sum ``L = Σ_t c_t · ℓ_t`` whose weights c_t
(:func:`token_weights`, ``algorithm.aggregation``) use GLOBAL denominators (:class:`Normaliser`,
counted over every rank and micro-batch of the step). So a micro-batch's loss is its own
contribution, and summing the micro-batch losses of all ranks gives the full-batch loss exactly: the
result does not depend on how the batch is split. ``seq_mean_token_mean`` needs each sequence whole
inside one micro-batch, as do the sequence-level parts of the losses that use :func:`seq_sum`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import torch
from torch import Tensor

from asyncrl.recipe import Aggregation

AGGREGATIONS: tuple[str, ...] = tuple(a for a in get_args(Aggregation) if a != "auto")


@dataclass(frozen=True, kw_only=True)
class Normaliser:
    """Global denominators of one optimizer step, the same on every rank and micro-batch.

    ``tokens``: tokens with mask 1 in the whole step; ``seqs``: sequences with at least one such
    token, each counted by its weight (a per-turn sample its share of its episode, so ``seqs``
    counts episodes; :func:`token_weights`); ``seq_len``: Dr. GRPO's constant L (use
    ``rollout.max_new_tokens``). Build it from :func:`count_tokens_and_seqs` summed over
    micro-batches and all-reduced over ranks. ``positions``: every input position of the step's
    sequences, trained or not, counted only for the MoE load-balancing loss (its mean is over all
    the tokens the routers saw; 0 when it is off).
    """

    tokens: float
    seqs: float
    seq_len: float = 1.0
    positions: float = 0.0


def count_tokens_and_seqs(
    mask: Tensor, seq_ids: Tensor, seq_weights: Tensor | None = None
) -> Tensor:
    """This micro-batch's share of the :class:`Normaliser`: float64 ``[tokens, seqs]`` on the
    tensors' device, to be summed; with ``seq_weights`` (per token, its sequence's weight) each
    sequence counts its weight. Nothing is read back to the host (a GPU step would wait for it):
    sequences are counted in ``[T]`` bins, so every id must be < T, as
    :func:`~asyncrl.learner.packing.pack`'s dense ids are."""
    f64 = torch.float64
    m = mask.bool()
    bins = torch.zeros(seq_ids.numel(), dtype=f64, device=seq_ids.device)
    trained = bins.index_add(0, seq_ids, m.to(f64)) > 0
    if seq_weights is None:
        seqs = trained.sum(dtype=f64)
    else:
        per_seq = bins.index_put((seq_ids,), seq_weights.to(f64))
        seqs = torch.where(trained, per_seq, 0.0).sum()
    return torch.stack([m.sum(dtype=f64), seqs])


def seq_sum(x: Tensor, seq_ids: Tensor) -> Tensor:
    """Σ of ``x`` over each token's sequence, on every token of it (``x`` 0 where it must not
    count). Differentiable in ``x``. Summed in ``[T]`` bins, without reading the ids back: every
    id must be < T (:func:`count_tokens_and_seqs`)."""
    n = seq_ids.numel()
    return torch.zeros(n, dtype=x.dtype, device=x.device).index_add_(0, seq_ids, x)[seq_ids]


def token_weights(
    mask: Tensor,
    seq_ids: Tensor,
    *,
    aggregation: str,
    norm: Normaliser,
    seq_weights: Tensor | None = None,
) -> Tensor:
    """The c_t of L = Σ_t c_t ℓ_t (0 where mask is 0), with N_tok, N_seq, L from ``norm``:
    - ``token_mean``:              c_t = 1 / N_tok
    - ``seq_mean_token_mean``:     c_t = w_i / (|y_i| · N_seq), |y_i| = mask-1 tokens of t's sequence
    - ``seq_mean_token_sum_norm``: c_t = 1 / (L · N_seq)   (Dr. GRPO: no length normalisation)

    w_i (``seq_weights``, per token; default 1) is the sequence's share of its episode's trained
    tokens: per-turn samples (``rollout.turn_samples``) of one episode share 1 (N_seq = Σ w_i
    counts episodes, :func:`count_tokens_and_seqs`), so under the sequence means an episode weighs
    as one sequence whatever its turns: ``seq_mean_token_mean``'s c_t = 1 / (|episode| · N_seq),
    ``seq_mean_token_sum_norm``'s sum over the episode's tokens. Episode A (3 turns, A = +1)
    against B (1 turn, A = −1) weighs 1/2 : 1/2 under the sequence mean, not 3/4 : 1/4.
    """
    m = mask.to(torch.float64)
    w = m if seq_weights is None else m * seq_weights.to(torch.float64)
    # N_seq: sequences count 1 each (≥ 1 when any token trains); weighted, a share of a turn's
    # episode may be less than 1 in a mini-batch holding only some of its turns
    seqs = norm.seqs if norm.seqs > 0 else 1.0
    if aggregation == "token_mean":
        c = m / max(norm.tokens, 1)
    elif aggregation == "seq_mean_token_mean":
        c = w / (seq_sum(m, seq_ids).clamp(min=1) * seqs)
    elif aggregation == "seq_mean_token_sum_norm":
        if norm.seq_len <= 0:
            raise ValueError(
                f"seq_mean_token_sum_norm needs a positive seq_len, got {norm.seq_len}"
            )
        c = m / (norm.seq_len * seqs)
    else:
        raise ValueError(f"algorithm.aggregation: unknown {aggregation!r}; one of {AGGREGATIONS}")
    return c
