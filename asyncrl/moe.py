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


def fit_routes(routes: np.ndarray | None, positions: int) -> np.ndarray | None:
    """An episode's routes over a sample's ``positions`` (its tokens but the last): tool output
    after the last generated token was never fed to a router, and gets expert 0. Those positions
    only follow every trained token (attention is causal), so no trained log-probability depends
    on them."""
    if routes is None or len(routes) == positions:
        return routes
    if len(routes) > positions:
        return routes[:positions]
    pad = np.zeros((positions - len(routes), *routes.shape[1:]), routes.dtype)
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
