"""What a mixture-of-experts model's config.json says about its routes, and how a sample's routes
are put together from the requests that made it (pure, no I/O; docs/moe.md).

The learner builds its MoE layers from the same rules (``asyncrl.recipe.moe_config``),
and the rollout client reads SGLang's routes with them (:class:`RouteShape`), so both agree on
which layers a route's rows are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncrl.recipe.moe_config import moe_layers, num_experts
from asyncrl.wire import route_dtype


@dataclass(frozen=True)
class RouteShape:
    """A model's routes: SGLang returns a row for each of its ``layers`` (a dense layer's zero),
    a sample keeps the ``moe`` ones, each ``top_k`` expert ids below ``experts``, stored in
    :attr:`dtype`."""

    layers: int
    moe: tuple[int, ...]
    top_k: int
    experts: int

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> RouteShape | None:
        """The routes of an HF config.json's model; None for a dense model."""
        sparse = moe_layers(cfg)
        if not any(sparse):
            return None
        return cls(
            layers=len(sparse),
            moe=tuple(i for i, s in enumerate(sparse) if s),
            top_k=int(cfg.get("num_experts_per_tok") or 0),
            experts=num_experts(cfg),
        )

    @property
    def dtype(self) -> np.dtype:
        return route_dtype(self.experts)


def route_problem(routes: np.ndarray, shape: RouteShape | None) -> str | None:
    """Why a sample's routes ``[positions, moe_layers, top_k]`` cannot be replayed on the model
    whose routes are ``shape`` (None: a dense model), or None when they can: its MoE layers and
    top-k, expert ids below its experts, and each position's ids distinct, as a router's top-k
    (TorchTitan's dispatch cannot lay out one token sent twice to one expert; on CUDA an id out
    of range is a device-side assert, which ends the process)."""
    if shape is None:
        return "given, but the model is dense (no MoE layer to replay them on)"
    want = (len(shape.moe), shape.top_k)
    if routes.ndim != 3 or routes.shape[1:] != want:
        return (
            f"[moe_layers, top_k] {list(routes.shape[1:])}, but the model's routes are "
            f"{list(want)} (does the generator serve another model?)"
        )
    if not routes.size:
        return None
    low, high = int(routes.min()), int(routes.max())
    if low < 0 or high >= shape.experts:
        return f"expert id {low if low < 0 else high} outside [0, {shape.experts})"
    # column against column, each contiguous: 2.5 ms for 4,096 positions of Qwen3-30B-A3B's 48
    # layers x top-8 (a sort along the last axis took 17 ms: seconds a step over a batch)
    k = routes.shape[-1]
    cols = np.ascontiguousarray(np.moveaxis(routes, -1, 0))
    for i in range(k - 1):
        same = cols[i] == cols[i + 1 :]
        if same.any():
            _, pos, layer = (int(v) for v in np.argwhere(same)[0])
            return (
                f"position {pos}, MoE layer {layer}: expert {int(routes[pos, layer, i])} twice "
                "in one top-k"
            )
    return None


def fit_routes(routes: np.ndarray | None, positions: int) -> np.ndarray | None:
    """An episode's routes over a sample's ``positions`` (its tokens but the last): tool output
    after the last generated token was never fed to a router, and gets experts 0..top_k-1 (each
    once, as a router's top-k: :func:`route_problem`). Those positions only follow every trained
    token (attention is causal), so no trained log-probability depends on them."""
    if routes is None or len(routes) == positions:
        return routes
    if len(routes) > positions:
        return routes[:positions]
    shape = (positions - len(routes), *routes.shape[1:])
    pad = np.broadcast_to(np.arange(shape[-1], dtype=routes.dtype), shape)
    return np.concatenate([routes, pad])


def splice_routes(earlier: np.ndarray | None, routes: np.ndarray, produced: int) -> np.ndarray:
    """One sample's routes from a request's (``routes``: its input's positions and its ``produced``
    tokens' but the last) and the ones before it (a resumed request, a conversation's earlier
    turns). A position an earlier request fed to sample a token keeps that request's experts:
    those produced the token's behaviour logprob. The rest (tool output, the prompt of a first
    request) takes this request's."""
    if earlier is None or not len(earlier):
        return routes
    first = len(routes) - produced  # this request's first sampling position, ``len(input) - 1``
    keep = min(len(earlier), max(first, 0))
    if not keep:
        return routes
    out = routes.copy()
    out[:keep] = earlier[:keep]
    return out
