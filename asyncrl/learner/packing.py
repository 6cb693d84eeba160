"""Pack samples into rows without padding, and split a batch over ranks and micro-batches.

A sample is ``prompt_ids + completion_ids``; the model reads ``ids[:-1]`` and predicts ``ids[1:]``, so
completion token j is predicted at row position ``len(prompt) - 1 + j``. Per-token data (loss mask,
behaviour logprobs, versions, advantage, and with a critic its values and returns) is placed at
those positions. Several samples share one row;
``positions`` restart at 0 at each sample, which is all the attention needs to keep them apart.

Pure logic (numpy in, torch out), no I/O: tested directly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

IGNORE_INDEX = -100


@dataclass(kw_only=True)
class Sequence:
    """One sample, ready to pack. Arrays have one entry per input position (``len(ids) - 1``)."""

    index: int  # position in the batch (global, the same on every rank)
    input_ids: np.ndarray  # int64 [n]
    labels: np.ndarray  # int64 [n], the next token
    mask: np.ndarray  # float32 [n], 1 where the label is a completion token to train on
    behavior_logp: np.ndarray  # float32 [n]
    versions: np.ndarray  # int64 [n], version that generated the label token
    advantage: float = 0.0
    reward: float = 0.0  # the sample's reward (token-level advantages start from it)
    mixed_versions: bool = False  # its trained tokens come from more than one version
    truncated: bool = False  # cut with no end token (max_new_tokens, max_seq_len): GAE bootstraps
    # its weight under the sequence-mean aggregations: a per-turn sample's share of its episode
    seq_weight: float = 1.0
    prox_logp: np.ndarray | None = None  # float32 [n], log π_prox when recomputed (``prox``)
    # With a critic (learner/critic.py), float32 [n] each, set before the updates:
    values: np.ndarray | None = None  # V(x_t) of the critic the returns were computed with
    token_advantages: np.ndarray | None = None  # A_t, replaces ``advantage``
    returns: np.ndarray | None = None  # R_t, the value targets
    ref_logp: np.ndarray | None = None  # log π_ref: a KL loss or reward (the ``ref`` call)
    teacher_logp: np.ndarray | None = None  # float32 [n], log π_teacher (distill), from the worker
    # [n, moe_layers, top_k]: the experts the generator routed each input position to (replay)
    routes: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.input_ids)


def make_sequence(
    index: int,
    prompt_ids: np.ndarray,
    completion_ids: np.ndarray,
    *,
    loss_mask: np.ndarray | None = None,
    behavior_logprobs: np.ndarray | None = None,
    versions: np.ndarray | None = None,
    advantage: float = 0.0,
    reward: float = 0.0,
    max_len: int = 0,
    teacher_logprobs: np.ndarray | None = None,
    routed_experts: np.ndarray | None = None,
) -> Sequence:
    """Lay one sample out for packing; ``max_len`` > 0 cuts the completion so the row fits the model.
    ``teacher_logprobs`` (one per completion token; None or empty: none) become ``teacher_logp``.
    ``routed_experts`` (one row per input position, ``len(ids) - 1``; None or empty: none) become
    ``routes``, cut with the row.

    A completion token with no prompt before it (empty prompt) cannot be predicted and is not trained.
    """
    p, c = len(prompt_ids), len(completion_ids)
    ids = np.concatenate([np.asarray(prompt_ids), np.asarray(completion_ids)]).astype(np.int64)
    n = len(ids) - 1
    if max_len and n > max_len:
        ids, n = ids[: max_len + 1], max_len
    per_token = {
        "mask": (np.ones(c, np.float32) if loss_mask is None else loss_mask, np.float32),
        "behavior_logp": (
            np.zeros(c, np.float32) if behavior_logprobs is None else behavior_logprobs,
            np.float32,
        ),
        "versions": (np.zeros(c, np.int64) if versions is None else versions, np.int64),
    }
    if teacher_logprobs is not None and len(teacher_logprobs):
        per_token["teacher_logp"] = (teacher_logprobs, np.float32)
    out = {}
    start = p - 1  # row position predicting completion token 0
    for name, (arr, dtype) in per_token.items():
        row = np.zeros(max(n, 0), dtype)
        arr = np.asarray(arr, dtype)
        lo, hi = max(start, 0), min(start + c, n)
        if hi > lo:
            row[lo:hi] = arr[lo - start : hi - start]
        out[name] = row
    trained = out["versions"][out["mask"] > 0]
    routes = None
    if routed_experts is not None and np.size(routed_experts):
        if len(routed_experts) != p + c - 1:
            raise ValueError(
                f"routed_experts has {len(routed_experts)} positions for {p} prompt and {c} "
                f"completion tokens (one per token but the last: {p + c - 1})"
            )
        routes = np.asarray(routed_experts)[: max(n, 0)]
    return Sequence(
        routes=routes,
        index=index,
        input_ids=ids[:-1],
        labels=ids[1:].copy(),
        advantage=float(advantage),
        reward=float(reward),
        mixed_versions=bool(trained.size) and int(trained.min()) != int(trained.max()),
        **out,
    )


def split_minibatches(
    seqs: list[Sequence], n: int, *, seed: int | tuple[int, ...]
) -> list[list[Sequence]]:
    """``n`` mini-batches of about equal tokens, drawn at random (the same for the same ``seed``):
    sequences in a random order, each to the lightest mini-batch so far."""
    parts: list[list[Sequence]] = [[] for _ in range(n)]
    load = [0] * n
    for i in np.random.default_rng(seed).permutation(len(seqs)):
        k = min(range(n), key=lambda j: (load[j], j))
        parts[k].append(seqs[i])
        load[k] += len(seqs[i])
    return [sorted(p, key=lambda s: s.index) for p in parts]


def split_over_ranks(seqs: list[Sequence], world: int) -> list[list[Sequence]]:
    """Balance sequences over ranks by tokens: longest first, each to the least loaded rank."""
    shards: list[list[Sequence]] = [[] for _ in range(world)]
    load = [0] * world
    for s in sorted(seqs, key=lambda s: (-len(s), s.index)):
        r = min(range(world), key=lambda i: (load[i], i))
        shards[r].append(s)
        load[r] += len(s)
    return [sorted(sh, key=lambda s: s.index) for sh in shards]


def split_micro_batches(seqs: list[Sequence], max_tokens: int) -> list[list[Sequence]]:
    """First-fit decreasing into bins of at most ``max_tokens`` (a longer sequence gets its own bin)."""
    bins: list[list[Sequence]] = []
    room: list[int] = []
    for s in sorted(seqs, key=lambda s: (-len(s), s.index)):
        for i, r in enumerate(room):
            if len(s) <= r:
                bins[i].append(s)
                room[i] -= len(s)
                break
        else:
            bins.append([s])
            room.append(max_tokens - len(s))
    return [sorted(b, key=lambda s: s.index) for b in bins]


@dataclass(kw_only=True)
class MicroBatch:
    """One packed row (batch dimension 1) and its per-token data.

    ``tokens``, ``positions``, ``labels`` are ``[1, L]``. The loss tensors are flat over ``sel``, the
    row positions whose label is a trained completion token (mask > 0: the only tokens a loss sees).

    What the step needs as numbers (the documents' lengths for the attention, the trained tokens and
    sequences for the normaliser, ``sel`` to put per-token results back on the sequences) packing
    knows on the host: they are kept here as Python values and numpy, so a step on a GPU never
    reads them back from the device (tests/learner/test_device_tier.py counts the reads).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    sel: torch.Tensor  # long [T], row positions of trained completion tokens (mask > 0)
    mask: torch.Tensor  # float [T]
    behavior_logp: torch.Tensor  # float [T]
    versions: torch.Tensor  # long [T]
    advantages: torch.Tensor  # float [T]
    mixed_versions: torch.Tensor  # bool [T], the token's sample has tokens of several versions
    prox_logp: torch.Tensor | None  # float [T] when every sequence carries a recomputed π_prox
    old_values: torch.Tensor | None  # float [T] with a critic: the values the returns came from
    returns: torch.Tensor | None  # float [T] with a critic: the value targets
    ref_logp: torch.Tensor | None  # float [T] when every sequence carries log π_ref
    teacher_logp: torch.Tensor | None  # float [T] when a sequence carries log π_teacher (distill)
    # long [1, L, moe_layers, top_k] when a sequence carries routes (-1 where one has none)
    routes: torch.Tensor | None = None
    # long [T], the token's sequence, numbered 0.. over the row's sequences that have trained
    # tokens: dense, so every id is < T, a bound the losses use without reading the device
    seq_ids: torch.Tensor
    seq_weights: torch.Tensor  # float64 [T], the token's sequence's ``seq_weight``
    seq_index: list[int]  # batch index of each sequence in the row
    num_tokens: int  # L
    doc_lengths: tuple[int, ...] = ()  # each sequence's length in the row (they sum to L)
    trained_tokens: int = 0  # T
    trained_seqs: float = 0.0  # Σ seq_weight over the sequences with trained tokens
    sel_host: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))

    @property
    def is_empty(self) -> bool:
        return not self.seq_index

    def to(self, device: torch.device) -> MicroBatch:
        """The same micro-batch with every tensor on ``device`` (no copy when already there)."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)


def pack(seqs: list[Sequence], *, pad_id: int = 0) -> MicroBatch:
    """Concatenate sequences into one row; an empty list gives a 1-token dummy row (no loss)."""
    if not seqs:
        z = torch.zeros(1, 1, dtype=torch.long)
        e = torch.zeros(0)
        return MicroBatch(
            tokens=z + pad_id,
            positions=z.clone(),
            labels=z + IGNORE_INDEX,
            sel=e.long(),
            mask=e,
            behavior_logp=e.clone(),
            versions=e.long(),
            advantages=e.clone(),
            mixed_versions=e.bool(),
            prox_logp=e.clone(),
            old_values=e.clone(),
            returns=e.clone(),
            ref_logp=e.clone(),
            teacher_logp=e.clone(),
            seq_ids=e.long(),
            seq_weights=e.double(),
            seq_index=[],
            num_tokens=1,
            doc_lengths=(1,),
        )
    cat = np.concatenate
    lengths = [len(s) for s in seqs]
    sel = np.nonzero(cat([s.mask > 0 for s in seqs]))[0]
    seq_ids = np.repeat(np.arange(len(seqs)), lengths)
    if all(s.token_advantages is not None for s in seqs):
        adv = cat([s.token_advantages for s in seqs])
    else:
        adv = np.repeat(np.array([s.advantage for s in seqs], np.float32), lengths)

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a))

    def per_token(name: str) -> torch.Tensor | None:
        """A per-position array every sequence carries, at the trained tokens; else None."""
        arrays = [getattr(s, name) for s in seqs]
        return t(cat(arrays)[sel]) if all(a is not None for a in arrays) else None

    # A sample without teacher logprobs has no trained token (learner/step.py refuses it else).
    teacher = [s.teacher_logp for s in seqs]
    if any(a is not None for a in teacher):
        teacher = [
            np.zeros(len(s), np.float32) if a is None else a
            for s, a in zip(seqs, teacher, strict=True)
        ]
        teacher_logp = t(cat(teacher)[sel])
    else:
        teacher_logp = None

    # dense sequence ids over the trained tokens (their sequences in row order), and the weighted
    # count of those sequences, summed as the normaliser did it on the device before
    trained, dense = np.unique(seq_ids[sel], return_inverse=True)
    weights = np.array([s.seq_weight for s in seqs], np.float64)
    trained_seqs = float(t(weights[trained]).sum()) if len(trained) else 0.0

    routes = None
    if any(s.routes is not None for s in seqs):
        shape = next(s.routes.shape[1:] for s in seqs if s.routes is not None)
        routes = t(
            cat(
                [
                    np.full((len(s), *shape), -1, np.int64)
                    if s.routes is None
                    else s.routes.astype(np.int64)
                    for s in seqs
                ]
            )
        )[None]

    return MicroBatch(
        routes=routes,
        tokens=t(cat([s.input_ids for s in seqs]))[None],
        positions=t(cat([np.arange(n, dtype=np.int64) for n in lengths]))[None],
        labels=t(cat([s.labels for s in seqs]))[None],
        sel=t(sel.astype(np.int64)),
        mask=t(cat([s.mask for s in seqs])[sel]),
        behavior_logp=t(cat([s.behavior_logp for s in seqs])[sel]),
        versions=t(cat([s.versions for s in seqs])[sel]),
        advantages=t(adv[sel]),
        mixed_versions=t(np.array([s.mixed_versions for s in seqs])[seq_ids[sel]]),
        prox_logp=per_token("prox_logp"),
        old_values=per_token("values"),
        returns=per_token("returns"),
        ref_logp=per_token("ref_logp"),
        teacher_logp=teacher_logp,
        seq_ids=t(dense.reshape(-1).astype(np.int64)),
        seq_weights=t(weights[seq_ids[sel]]),
        seq_index=[s.index for s in seqs],
        num_tokens=int(sum(lengths)),
        doc_lengths=tuple(lengths),
        trained_tokens=len(sel),
        trained_seqs=trained_seqs,
        sel_host=sel.astype(np.int64),
    )
