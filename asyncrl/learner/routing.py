"""Rollout routing replay (R3, ``algorithm.routing_replay``; docs/moe.md): the learner's MoE
routers send each token to the experts the generator's router chose for it.

On an MoE policy the learner's router and the generator's pick different experts for some tokens
(other kernels, other batch shapes, and with staleness other weights), so a token's π and μ come
from different sub-networks and the importance ratio measures routing noise. With replay every
token of a sample runs through the generator's experts; the gating weights are the current
router's scores gathered at those experts, renormalized as ``norm_topk_prob`` says, so the router
still gets a gradient and still learns.

The routes travel on the micro-batch (:class:`~asyncrl.learner.packing.MicroBatch` ``routes``,
``-1`` where a position has none: a sample without routes, padding); :func:`set_routes` puts them
on the model's routers before each forward and leaves them there, so that a backward's recompute
(activation checkpointing) routes as the forward did. Whether replayed or not, each router counts
the (token, MoE layer) routings where its own top-k set equals the generator's
(:func:`agreement`), logged every step as ``learner/routing_agreement``.

The auxiliary load-balancing loss (``algorithm.moe_aux_loss_coef``, :func:`load_balancing_loss`)
needs each router's scores and the experts it used in the actor's training forward:
:func:`record_routing` has the routers keep them for one forward, :func:`recorded_aux_loss` reads
them and stops the recording (so a backward's recompute records nothing). Off, a router keeps
nothing and runs not one more op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.models.common.moe import TokenChoiceTopKRouter


class RoutesError(ValueError):
    """A micro-batch's routes do not fit the model (one line, naming what disagrees)."""


class ReplayRouter(TokenChoiceTopKRouter):
    """TorchTitan's token-choice top-k router that can take recorded experts.

    With no routes set it is TorchTitan's router, op for op (the learner's numbers are those of
    a run without routes). With routes ``[B, L, K]`` (``-1``: the router's own choice) it counts
    where its own choice agrees, and with ``replay`` routes the tokens to the recorded experts,
    gating them with its current scores there."""

    @dataclass(kw_only=True, slots=True)
    class Config(TokenChoiceTopKRouter.Config):
        pass

    def __init__(self, config: Config):
        super().__init__(config)
        self.routes: torch.Tensor | None = None
        self.replay = False
        self.agree: torch.Tensor | None = None  # float64 [2]: agreeing routings, routings
        # (scores [B, L, E], experts used [B, L, K]) of each forward while recording, else None
        self.record: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def forward(
        self, x_BLD: torch.Tensor, expert_bias_E: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = self._route(x_BLD, expert_bias_E)
        if self.record is not None:  # the experts used: the replayed ones under replay
            self.record.append((out[2], out[1]))
        return out

    def _route(
        self, x_BLD: torch.Tensor, expert_bias_E: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        top_BLK, own_BLK, scores_BLE = super().forward(x_BLD, expert_bias_E)
        routes = self.routes
        if routes is None:
            return top_BLK, own_BLK, scores_BLE
        if routes.shape != own_BLK.shape:
            raise RoutesError(
                f"routes of shape {list(routes.shape)} for a micro-batch routed as "
                f"{list(own_BLK.shape)} (tokens x top_k)"
            )
        have = routes[..., :1] >= 0  # [B, L, 1]: the position has recorded experts
        with torch.no_grad():
            same = (own_BLK.sort(-1).values == routes.sort(-1).values).all(-1, keepdim=True)
            counts = torch.stack(((same & have).sum(), have.sum())).to(torch.float64)
            self.agree = counts if self.agree is None else self.agree + counts
        if not self.replay:
            return top_BLK, own_BLK, scores_BLE
        ids_BLK = torch.where(have, routes, own_BLK)
        top_BLK = scores_BLE.gather(dim=-1, index=ids_BLK)  # as TorchTitan's router gates
        if self.route_norm:
            top_BLK = top_BLK / (top_BLK.sum(dim=-1, keepdim=True) + 1e-20)
        return top_BLK * self.route_scale, ids_BLK, scores_BLE


def routers(model: torch.nn.Module) -> list[ReplayRouter]:
    """The model's MoE routers, in layer order."""
    return [m for m in model.modules() if isinstance(m, ReplayRouter)]


def set_routes(model: torch.nn.Module, routes: torch.Tensor | None, *, replay: bool) -> None:
    """Give each MoE layer its routes ``[B, L, moe_layers, K]`` (None: none, every router chooses
    and counts nothing) before a forward; ``replay``: and route by them."""
    rs = routers(model)
    if routes is not None and routes.shape[2] != len(rs):
        raise RoutesError(
            f"samples' routed_experts have {routes.shape[2]} MoE layers, the model {len(rs)}"
        )
    for j, r in enumerate(rs):
        r.routes = None if routes is None else routes[:, :, j]
        r.replay = replay


def agreement(model: torch.nn.Module | None, *, reset: bool = False) -> torch.Tensor:
    """The routings (token, MoE layer) whose top-k set equalled the generator's, and all that had
    the generator's, summed over the model's routers since the last reset (float64 ``[2]``, on the
    host when there are none); ``reset`` zeroes the count after reading it."""
    total = torch.zeros(2, dtype=torch.float64)
    for r in routers(model) if model is not None else []:
        if r.agree is not None:
            total = r.agree + total.to(r.agree.device)
        if reset:
            r.agree = None
    return total


def record_routing(model: torch.nn.Module) -> list[ReplayRouter]:
    """Have the model's routers keep their scores and experts for the next forward (read by
    :func:`recorded_aux_loss`); returns them (none on a dense model)."""
    rs = routers(model)
    for r in rs:
        r.record = []
    return rs


def recorded_aux_loss(rs: list[ReplayRouter]) -> torch.Tensor | None:
    """The load-balancing loss of the forward the routers ``rs`` recorded (every position of its
    rows: a packed micro-batch has no padding), with its gradient into the routers; stops the
    recording, so that a backward's recompute of the forward (activation checkpointing) adds
    nothing. None when nothing was recorded."""
    records = [r.record[0] for r in rs if r.record]
    for r in rs:
        r.record = None
    if not records:
        return None
    e = rs[0].num_experts
    return load_balancing_loss(
        [s.reshape(-1, e) for s, _ in records],
        [ids.reshape(-1, ids.shape[-1]) for _, ids in records],
        num_experts=e,
    )


def load_balancing_loss(
    probs: list[torch.Tensor], experts: list[torch.Tensor], *, num_experts: int
) -> torch.Tensor:
    """The Switch Transformer's auxiliary loss as transformers' Qwen3-MoE computes it
    (``load_balancing_loss_func``, its ``router_aux_loss_coef`` term), so that a coefficient means
    what it means there: ``E · Σ_e f_e · P_e`` with, pooled over the MoE layers and the tokens
    (R = layers × tokens), f_e = (routings to e) / R (so Σ_e f_e = top_k) and P_e = the sum of e's
    router probabilities / R. Minimal (top_k) when the routings and the probabilities are uniform;
    only P carries a gradient (the top-k choice has none).

    ``probs``: per MoE layer, the router's softmax ``[N, E]`` of the tokens that count (a packed
    micro-batch has no padding; transformers drops a padded batch's by its attention mask);
    ``experts``: the experts each token went to ``[N, K]`` (transformers takes the top-k of
    ``probs``; under routing replay these are the replayed ones, the experts actually trained).
    Computed in float32."""
    dev = probs[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=dev)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=dev)
    rows = 0
    for p, ids in zip(probs, experts, strict=True):
        flat = ids.reshape(-1).long()
        counts = counts.scatter_add(0, flat, torch.ones(flat.numel(), device=dev))
        prob_sum = prob_sum + p.float().sum(0)
        rows += p.shape[0]
    return num_experts * torch.sum((counts / rows) * (prob_sum / rows))
