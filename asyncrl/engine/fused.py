"""The engine's fused projections: which linear layers run as one matmul, and how a weight update's
tensors become that one tensor without a copy.

A group's members are concatenated along dim 0 (q rows, then k, then v; gate then up), so each
member is a row slice of the fused tensor. A weight-update session receives every member straight
into its slice of a buffer allocated for that session (:class:`ReceiveBuffers`), and the swap then
adopts the buffer itself (:func:`fuse` finds the members back to back in one storage). Anything
else (a group only partly updated in a session, a tensor converted on its way in, weights read from
disk, the model as loaded) is fused by a copy, as before: every byte of the model once more, which
at a weight sync's end the learner would wait on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

FUSED = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


@dataclass
class Fused:
    """One matmul standing for several linear layers; their parameters are views into it."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    ptrs: tuple[int, ...]  # the members' data pointers when fused: a swap changes them


@dataclass(frozen=True)
class Group:
    """The parameter names of one fused group, in fused order, and each member's rows."""

    key: tuple[int, str]  # (layer, block)
    weights: tuple[str, ...]
    biases: tuple[str, ...] | None  # every member's bias, or None (then none is fused)
    rows: tuple[int, ...]
    cols: int


def ptrs(pairs: Iterable[tuple[torch.Tensor, torch.Tensor | None]]) -> tuple[int, ...]:
    """The data pointers of (weight, bias) pairs: what identifies a fused group's members."""
    return tuple(t.data_ptr() for pair in pairs for t in pair if t is not None)


def joined(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor whose consecutive row slices ``parts`` are, if they are that already (contiguous,
    back to back in order in one storage): a view, no copy. None otherwise."""
    first = parts[0]
    at, storage = first.data_ptr(), first.untyped_storage().data_ptr()
    for p in parts:
        if (
            p.dtype != first.dtype
            or p.shape[1:] != first.shape[1:]
            or not p.is_contiguous()
            or p.untyped_storage().data_ptr() != storage
            or p.data_ptr() != at
        ):
            return None
        at += p.numel() * p.element_size()
    shape = (sum(p.shape[0] for p in parts), *first.shape[1:])
    strides = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return first.as_strided(shape, strides, first.storage_offset())


def fuse(
    weights: list[torch.Tensor], biases: list[torch.Tensor | None]
) -> tuple[Fused, list[tuple[torch.Tensor, torch.Tensor | None]]]:
    """One tensor for the members, and each member's (weight, bias) view into it: the members
    themselves when they are row slices of one tensor already (:func:`joined`), else a copy."""
    has_bias = all(x is not None for x in biases)
    w, b = joined(weights), joined(biases) if has_bias else None  # type: ignore[arg-type]
    if w is not None and (b is not None or not has_bias):
        pairs = list(zip(weights, biases if has_bias else [None] * len(weights), strict=True))
        return Fused(weight=w, bias=b, ptrs=ptrs(pairs)), pairs
    rows = [x.shape[0] for x in weights]
    w = torch.cat(weights)
    b = torch.cat(biases) if has_bias else None  # type: ignore[arg-type]
    bs = b.split(rows) if b is not None else [None] * len(rows)
    views = list(zip(w.split(rows), bs, strict=True))
    return Fused(weight=w, bias=b, ptrs=ptrs(views)), views


class ReceiveBuffers:
    """One weight-update session's receive buffers for the fused groups' members: a member's
    tensor is its row slice of its group's buffer, allocated at the group's first member. New for
    every session, since the previous session's buffers are what the engine serves until the swap.
    Only for tensors that arrive in the model's dtype on its device (else the store converts them
    anyway, and the swap copies)."""

    def __init__(self, groups: list[Group], dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, device
        self._slots: dict[str, tuple[Group, int, bool]] = {}
        for g in groups:
            for i, name in enumerate(g.weights):
                self._slots[name] = (g, i, False)
            for i, name in enumerate(g.biases or ()):
                self._slots[name] = (g, i, True)
        self._buffers: dict[tuple[tuple[int, str], bool], torch.Tensor] = {}

    def get(
        self, name: str, dtype: torch.dtype, shape: list[int], device: torch.device
    ) -> torch.Tensor | None:
        """Where to receive parameter ``name``: its slice of its group's buffer, or None (not a
        fused member, or not arriving as the model holds it: receive it on its own)."""
        slot = self._slots.get(name)
        if slot is None or dtype != self.dtype or torch.device(device) != self.device:
            return None
        g, i, bias = slot
        want = (g.rows[i],) if bias else (g.rows[i], g.cols)
        if tuple(shape) != want:
            return None
        buf = self._buffers.get((g.key, bias))
        if buf is None:
            size = (sum(g.rows),) if bias else (sum(g.rows), g.cols)
            buf = self._buffers[g.key, bias] = torch.empty(
                size, dtype=self.dtype, device=self.device
            )
        start = sum(g.rows[:i])
        return buf[start : start + g.rows[i]]
