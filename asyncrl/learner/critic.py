"""PPO's critic: a value model V(x_t) trained beside the actor (``algorithm.advantage: gae`` or
``vtrace``; docs/design.md §11).

The critic is the scalar-head model of :mod:`asyncrl.learner.scalar_model`, built on its ranks
(``placement.critic``: :mod:`asyncrl.learner.placement`) with FSDP2 like the actor, from
``critic.path`` (a causal LM: its backbone and a fresh head; a sequence-classification folder such
as the reward model: backbone and head). Its model, optimizer and LR schedule are part of the
learner's DCP checkpoint, so a resumed run continues it exactly.

Per batch (the learner's ``values`` and ``train_critic`` calls, :mod:`asyncrl.learner.calls`, on the
critic's ranks):
1. before the updates, V at every trained token of this rank's sequences (forward only), then
   :func:`token_targets` gives each token's advantage A_t and value target R_t from the sample's
   reward at its last trained token (GAE, or V-trace with π/μ; a KL reward with π_prox), and the
   advantages are whitened over the whole batch (every rank's tokens);
2. at each actor update, one critic update on the same micro-batches (on the actor's ranks; on its
   own, the same mini-batch draws at the same time as the actor's): the clipped value loss of
   :func:`~asyncrl.learner.losses.scalar.value_loss` against R_t, with V_old the values of step 1.

Values sit at the positions the actor's logprobs do: the hidden state that predicts completion
token t has read the prompt and tokens < t, the state in which the policy chose token t.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torchtitan.components.checkpoint import ModelWrapper
from torchtitan.distributed import utils as dist_utils

from asyncrl import metric_names as names
from asyncrl.learner.advantages import gae, kl_shaped_rewards, last_token_rewards, vtrace
from asyncrl.learner.losses.aggregation import Normaliser
from asyncrl.learner.losses.scalar import explained_variance_from_sums, value_loss, variance_sums
from asyncrl.learner.packing import MicroBatch, Sequence
from asyncrl.learner.scalar_model import init_head, scalar_spec, token_values
from asyncrl.recipe import AlgorithmConfig

if TYPE_CHECKING:
    from asyncrl.learner.build import Builder
    from asyncrl.learner.config import TrainerConfig

WHITEN_EPS = 1e-8
"""Added to the batch's advantage std before dividing (verl's and OpenRLHF's whitening)."""

CRITIC_STATES = ("critic", "critic_optimizer", "critic_lr_scheduler")
"""The critic's model, optimizer and LR schedule: extra states of the learner's DCP checkpoint."""

VALUE_STAT_KEYS = ("value_loss", "value_tokens", "value_clipped")
"""The critic's per-update sums, reduced over ranks with the actor's (every rank the same keys)."""


def token_targets(seqs: list[Sequence], alg: AlgorithmConfig) -> None:
    """Each sequence's ``token_advantages`` and ``returns`` (per position, 0 off its trained tokens)
    from its ``reward`` on its last trained token and its critic ``values``; V-trace also reads
    μ (``behavior_logp``) and π (``prox_logp``), a KL reward π_prox and π_ref (``ref_logp``).
    Pure; not whitened.

    The sequences' trained tokens become the rows of one padded ``[B, T]`` problem: GAE and V-trace
    run backwards over each row's mask-1 tokens only, so a multi-turn sample's tool output (mask 0)
    is skipped, and the episode ends after its last trained token, unless the sequence is
    ``truncated`` (cut at ``max_new_tokens``): then the value after it is its last value."""
    if not seqs:
        return
    at = [np.nonzero(s.mask > 0)[0] for s in seqs]
    width = max(1, max(len(i) for i in at))

    def rows(get: Any) -> Tensor:
        out = torch.zeros(len(seqs), width, dtype=torch.float64)
        for b, (s, i) in enumerate(zip(seqs, at, strict=True)):
            if len(i):
                out[b, : len(i)] = torch.from_numpy(np.asarray(get(s), np.float64)[i])
        return out

    mask = rows(lambda s: np.ones(len(s)))
    values, mu = rows(lambda s: s.values), rows(lambda s: s.behavior_logp)
    scores = torch.tensor([s.reward for s in seqs], dtype=torch.float64)
    rewards = last_token_rewards(scores, mask)
    cut = torch.tensor([s.truncated for s in seqs])  # no end token: bootstrap, not V = 0
    prox = None
    if alg.kl_reward_coef > 0 or alg.advantage == "vtrace":
        missing = [s.index for s, i in zip(seqs, at, strict=True) if len(i) and s.prox_logp is None]
        if missing:
            raise ValueError(
                f"sequences {missing[:5]} have no prox_logp: algorithm.kl_reward_coef and "
                "advantage vtrace read log π_prox (the dataflow's prox call)"
            )
        prox = rows(lambda s: s.prox_logp)
    if alg.kl_reward_coef > 0:
        # log π_prox, not log μ: the sampler's logprob would add β·∇KL(π ‖ μ) to every update
        # (docs/off-policy.md, "The KL-shaped reward").
        assert prox is not None
        ref = rows(lambda s: s.ref_logp)
        rewards = kl_shaped_rewards(rewards, prox, ref, mask, beta=alg.kl_reward_coef)
    if alg.advantage == "vtrace":
        assert prox is not None
        adv, ret = vtrace(
            rewards,
            values,
            prox,
            mu,
            mask,
            gamma=alg.gamma,
            lam=alg.lam,
            rho_bar=alg.vtrace_rho_bar,
            c_bar=alg.vtrace_c_bar,
            truncated=cut,
        )
    else:
        adv, ret = gae(rewards, values, mask, gamma=alg.gamma, lam=alg.lam, truncated=cut)
    for b, (s, i) in enumerate(zip(seqs, at, strict=True)):
        s.token_advantages = np.zeros(len(s), np.float32)
        s.returns = np.zeros(len(s), np.float32)
        s.token_advantages[i] = adv[b, : len(i)].numpy()
        s.returns[i] = ret[b, : len(i)].numpy()


def assign_targets(
    seqs: list[Sequence],
    alg: AlgorithmConfig,
    *,
    reduce: bool,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """``seqs`` (carrying ``values``) get whitened advantages and returns; returns the batch's
    critic metrics. With ``reduce`` the sequences are this rank's data-parallel share and the
    whitening and the metrics span the data-parallel ``group`` (collective); without, ``seqs`` are
    the whole batch (no collective: roles on their own ranks, where every rank computes them all
    alike)."""
    token_targets(seqs, alg)
    adv = [s.token_advantages[s.mask > 0] for s in seqs]
    a = np.concatenate(adv) if adv else np.zeros(0)
    v = np.concatenate([s.values[s.mask > 0] for s in seqs]) if seqs else np.zeros(0)
    ret = np.concatenate([s.returns[s.mask > 0] for s in seqs]) if seqs else np.zeros(0)
    a64 = torch.from_numpy(a.astype(np.float64))
    sums = torch.cat(
        [
            torch.tensor([float(a.size), float(a64.sum()), float(a64.square().sum())]),
            torch.tensor([float(v.sum())], dtype=torch.float64),
            variance_sums(torch.from_numpy(v), torch.from_numpy(ret), torch.ones(v.size)),
        ]
    ).to(torch.float64)
    if reduce:
        dist.all_reduce(sums, group=group)
    n, a_sum, a_sq, v_sum = sums[:4].tolist()
    mean = a_sum / n if n else 0.0
    std = math.sqrt(max(a_sq / n - mean * mean, 0.0)) if n else 0.0
    for s in seqs:
        s.token_advantages = np.where(
            s.mask > 0, (s.token_advantages - mean) / (std + WHITEN_EPS), 0.0
        ).astype(np.float32)
    return {
        names.EXPLAINED_VARIANCE: explained_variance_from_sums(sums[4:]),
        "critic/values_mean": v_sum / n if n else 0.0,
        "critic/returns_mean": float(sums[5] / n) if n else 0.0,
        "critic/advantages_std": std,
    }


def critic_zero_stats(device: torch.device | None = None) -> dict[str, Tensor]:
    """The critic's per-update sums at zero, on ``device`` with the actor's (added to there, read
    once at the step's end): every rank reduces these keys, critic or not."""
    return {k: torch.zeros((), dtype=torch.float64, device=device) for k in VALUE_STAT_KEYS}


class Critic:
    """The value model on this rank: built, loaded and optimised as the actor is (collective over
    the critic's ranks: ``build.meshes["critic"]``)."""

    def __init__(self, c: TrainerConfig, build: Builder) -> None:
        self.alg = c.algorithm
        self.grad_clip = c.learner.grad_clip
        self.folder = c.critic_dir
        self.spec = scalar_spec(self.folder, attention=c.attention, max_seq_len=c.max_seq_len)
        self.model = build.model(self.spec, "critic")
        self.model.train()
        self.adapter = self.spec.state_dict_adapter(self.spec.model, str(self.folder))
        build.load_hf(self.model, self.adapter, self.folder, group=build.meshes["critic"].group)
        if not self.adapter.include_head:  # a causal LM's backbone: a fresh head from the seed
            init_head(self.model, c.seed)
        self.optimizers, self.lr_schedulers = build.optimizer(self.model, c.critic.lr)

    def states(self) -> dict[str, Any]:
        """The critic's part of the learner's checkpoint (resumed from it, not from the folder)."""
        return dict(
            zip(
                CRITIC_STATES,
                (ModelWrapper([self.model]), self.optimizers, self.lr_schedulers),
                strict=True,
            )
        )

    @torch.no_grad()
    def values(self, mb: MicroBatch) -> Tensor:
        """V at each trained token of ``mb`` (flat over ``mb.sel``). Collective (FSDP)."""
        return token_values(self.model, mb.tokens, mb.positions, mb.doc_lengths)[mb.sel]

    def update(self, mbs: list[MicroBatch], norm: Normaliser, stats: dict[str, Tensor]) -> Tensor:
        """One optimizer update of the critic on an actor update's micro-batches (collective),
        its loss normalised as the actor's (``norm``, token mean); adds to ``stats`` (on the
        device: nothing is read back here); returns the gradient norm before clipping."""
        self.optimizers.zero_grad()
        for mb in mbs:
            v = token_values(self.model, mb.tokens, mb.positions, mb.doc_lengths)
            if mb.sel.numel() == 0:  # FSDP's backward runs on every rank: a zero gradient
                (v.sum() * 0.0).backward()
                continue
            loss, st = value_loss(
                v[mb.sel],
                mb.old_values,
                mb.returns,
                mask=mb.mask,
                seq_ids=mb.seq_ids,
                clip=self.alg.value_clip,
                aggregation="token_mean",
                norm=norm,
            )
            loss.backward()
            stats["value_loss"] += loss.detach().to(torch.float64)
            for k, x in st.items():
                stats[k] += x
        clip = self.grad_clip if self.grad_clip > 0 else math.inf
        grad_norm = dist_utils.clip_grad_norm_(list(self.model.parameters()), clip, foreach=True)
        self.optimizers.step()
        self.lr_schedulers.step()
        return grad_norm.detach()
