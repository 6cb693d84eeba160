"""``algorithm.loss: reward_model``: Bradley–Terry training of a scalar-head model on preference pairs.

The same kind of run as sft (a local data set, no rollouts): the batch source is
:class:`~asyncrl.learner.dataset_sources.PreferenceSource` (a group of two samples per pair, chosen
first), and the learner is the policy's :class:`~asyncrl.learner.trainer.Trainer` with the scalar head of
:mod:`asyncrl.learner.scalar_model` and :class:`RewardModelSteps` for its step: every sequence's
score is the head's value at its last token, and the loss is ``-log σ(r_chosen - r_rejected)``
averaged over the batch's pairs. Checkpoints and resume are the Trainer's; exports are HF
sequence-classification folders that transformers, SGLang's ``/classify`` and the built-in engine
serve. Held-out pairs (``data.eval_path``) give the pairwise accuracy at ``run.eval_every`` and at
the last version (``rm/eval_accuracy``, also in summary.json).
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torchtitan.distributed import utils as dist_utils

from asyncrl import metric_names as names
from asyncrl.learner.losses.scalar import bradley_terry
from asyncrl.learner.models import LearnerError, Models
from asyncrl.learner.scalar_model import (
    init_head,
    token_values,
)
from asyncrl.learner.source import Batch
from asyncrl.learner.step import StepResult, peak_memory

Pair = tuple[np.ndarray, np.ndarray]
"""(chosen, rejected): each the whole sequence's token ids, prompt then completion."""


def pair_bins(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Pairs (by their two sequences' total length) into micro-batches of at most ``max_tokens``
    tokens, first-fit decreasing; a longer pair gets a bin of its own. Pure."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b in range(len(bins)):
            if loads[b] + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


def batch_pairs(batch: Batch, max_len: int) -> list[Pair]:
    """The batch's pairs as whole sequences, each cut to ``max_len`` tokens."""
    out = []
    for g in batch.groups:
        if len(g.samples) != 2:
            continue
        c, r = (np.concatenate([s.prompt_ids, s.completion_ids])[:max_len] for s in g.samples)
        out.append((c, r))
    return out


class RewardModelSteps:
    """The reward model's training, a second executor over the learner's :class:`Models` beside
    the policy's :func:`asyncrl.learner.step.train_step`: the actor is the scalar-head model, and a
    step is one Bradley–Terry update on the batch's pairs. The Trainer builds, checkpoints and
    exports the model as for the policy (the scalar spec, a sequence-classification export)."""

    def __init__(self, models: Models, *, dp_rank: int, dp_size: int, dp_group: Any) -> None:
        if not models.meshes["actor"].whole_world:  # its step is written for every rank
            raise LearnerError(
                "placement.actor.ranks: the reward model trains on every learner rank, got "
                f"{models.config.placement.actor.ranks}"
            )
        self.models, self.config = models, models.config
        self.dp_rank, self.dp_size, self.dp_group = dp_rank, dp_size, dp_group
        self.model: torch.nn.Module = models.actor  # type: ignore[assignment]
        self._eval_pairs: list[Pair] | None = None

    def start(self, adapter: Any, *, fresh: bool) -> None:
        """A causal LM's backbone gets a new head at a fresh start; from then on the weights carry
        the head (exports and checkpoints)."""
        if fresh and not adapter.include_head:
            init_head(self.model, self.config.seed)
        adapter.include_head = True  # loaded: exports carry the head from now on
        adapter.include_bias = True

    # -- scores ----------------------------------------------------------------------------------

    def scores(self, seqs: list[np.ndarray]) -> torch.Tensor:
        """Each sequence's score (the head's value at its last token), packed into one row.

        Collective (an FSDP forward): a rank with no sequences passes ``[]`` and gets a score of a
        one-token row, to multiply by 0."""
        if not seqs:
            seqs = [np.zeros(1, np.int64)]
        device = self.models.device
        tokens = torch.from_numpy(np.concatenate(seqs).astype(np.int64))[None].to(device)
        positions = torch.cat([torch.arange(len(s)) for s in seqs])[None].to(device)
        ends = torch.from_numpy(np.cumsum([len(s) for s in seqs]) - 1).to(device)
        lengths = tuple(len(s) for s in seqs)  # the attention's documents, read from no device
        return token_values(self.model, tokens, positions, lengths)[ends]

    def _micro_batches(self, pairs: list[Pair]) -> list[list[Pair]]:
        """This rank's pairs in micro-batches; every rank runs as many (FSDP's collectives pair up),
        padding with empty ones."""
        lengths = [len(c) + len(r) for c, r in pairs]
        bins = [
            [pairs[i] for i in b]
            for b in pair_bins(lengths, self.config.learner.micro_batch_tokens)
        ]
        n = torch.tensor([len(bins)], dtype=torch.int64)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        return bins + [[] for _ in range(int(n) - len(bins))]

    # -- the step --------------------------------------------------------------------------------

    def step(self, batch: Batch, version: int) -> StepResult:
        """One optimizer update on the batch's pairs from ``version`` (collective; every rank passes
        the same batch): the loss of each pair over the GLOBAL number of pairs, summed over
        micro-batches."""
        t0 = time.perf_counter()
        pairs = batch_pairs(batch, self.models.max_seq_len)
        mine = pairs[self.dp_rank :: self.dp_size]
        n_pairs = max(len(pairs), 1)
        # loss sum, correct pairs, margin sum, tokens: on the device, read once at the end
        totals = torch.zeros(4, dtype=torch.float64, device=self.models.device)
        mbs = self._micro_batches(mine)
        optimizers, lr_schedulers = self.models.optimizers, self.models.lr_schedulers
        assert optimizers is not None and lr_schedulers is not None
        optimizers.zero_grad()
        for mb in mbs:
            s = self.scores([x for pair in mb for x in pair])
            if not mb:
                (s.sum() * 0.0).backward()
                continue
            loss, stats = bradley_terry(s[0::2], s[1::2], pairs=n_pairs)
            loss.backward()
            sums = (
                loss.detach().to(torch.float64) * n_pairs,
                stats["rm_correct"],
                stats["rm_margin"],
            )
            totals[:3] += torch.stack([x.to(torch.float64) for x in sums])
            totals[3] += float(sum(len(c) + len(r) for c, r in mb))
        clip = self.config.learner.grad_clip
        grad_norm = dist_utils.clip_grad_norm_(
            list(self.model.parameters()), clip if clip > 0 else math.inf, foreach=True
        )
        lr = lr_schedulers.schedulers[0].get_last_lr()[0]
        optimizers.step()
        lr_schedulers.step()
        version += 1
        dist.all_reduce(totals, group=self.dp_group)
        # the step's one read: the summed totals and the gradient norm (the same on every rank)
        norm = grad_norm.detach().to(torch.float64).reshape(1)
        loss, correct, margin, tokens, grad_norm = torch.cat([totals, norm]).tolist()
        dt = time.perf_counter() - t0
        metrics = {
            names.LOSS: loss / n_pairs,
            names.RM_LOSS: loss / n_pairs,
            names.RM_ACCURACY: correct / n_pairs,
            names.RM_MARGIN: margin / n_pairs,
            names.GRAD_NORM: grad_norm,
            "lr": float(lr),
            "learner/step_s": dt,
            names.TRAINED_TOKENS: tokens,
            names.TRAINED_TOKENS_PER_S: tokens / dt if dt > 0 else 0.0,
            "learner/micro_batches": float(len(mbs)),
            "learner/sequences": float(2 * len(pairs)),
        }
        metrics |= peak_memory()
        for k, v in batch.stats.items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                metrics.setdefault(k, float(v))
        every = self.config.held_out.every
        if version >= self.config.steps or (every and version % every == 0):
            acc = self.held_out_accuracy()
            if acc is not None:
                metrics[names.RM_EVAL_ACCURACY] = acc
        return StepResult(version=version, loss=loss / n_pairs, metrics=metrics)

    # -- held-out pairs --------------------------------------------------------------------------

    def _load_eval_pairs(self) -> list[Pair]:
        from asyncrl.learner.dataset_sources import PreferenceSource, load_preference_rows

        held = self.config.held_out
        assert held.path is not None
        rows = load_preference_rows(held.path, held.data)
        rows = rows[: held.limit] if held.limit else rows
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(self.config.model_dir))
        src = PreferenceSource(rows, tok, batch_size=1, chat_template=held.data.chat_template)
        out = []
        for row in rows:
            p, c, rej = src.pair(row)
            out.append(
                (
                    np.concatenate([p, c])[: self.models.max_seq_len],
                    np.concatenate([p, rej])[: self.models.max_seq_len],
                )
            )
        return out

    @torch.no_grad()
    def held_out_accuracy(self) -> float | None:
        """The fraction of ``data.eval_path``'s pairs (the first ``run.eval_prompts``) the model
        ranks right, chosen over rejected (collective; None without held-out pairs)."""
        if self.config.held_out.path is None:
            return None
        if self._eval_pairs is None:
            self._eval_pairs = self._load_eval_pairs()
        mine = self._eval_pairs[self.dp_rank :: self.dp_size]
        counts = torch.zeros(2, dtype=torch.float64, device=self.models.device)  # read once
        self.model.eval()
        try:
            for mb in self._micro_batches(mine):
                s = self.scores([x for pair in mb for x in pair])
                if mb:
                    counts[0] += (s[0::2] > s[1::2]).sum()
                    counts[1] += len(mb)
        finally:
            self.model.train()
        dist.all_reduce(counts, group=self.dp_group)
        right, total = counts.tolist()
        return right / total if total > 0 else None
