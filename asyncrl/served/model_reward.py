"""A learned reward model as a reward: completions scored by ``/classify`` servers (SGLang, or the
built-in engine on a sequence-classification folder), in batches, added to the rule reward.

``rollout.reward_model`` (docs/reward-models.md) names the servers. Samples travel in batches of up
to ``batch_size`` completions (:mod:`asyncrl.served.server_batches`: as ``input_ids``, prompt +
completion, the same tokens the policy produced; or as text for a reward model with another
tokenizer). A request is bounded by ``timeout_s``; one that a server cannot take (connection, HTTP
error, an answer without a finite score) goes to the next server. A batch that no server scored
within the bound fails each of its samples as any reward does
(:mod:`asyncrl.rewards`): a recorded ``failure``, and a rollout leaves the sample out of its
group (:mod:`asyncrl.rollout.group_maker`).

The sample's reward is ``reward_weight · rule + weight · normalised score``; ``rollout.reward: model``
leaves the rule out. Normalisation: none, fixed ``(s - shift) / scale``, or running ``(s - mean) /
std`` over the scores this worker has seen (before the first batch: unnormalised). A running
normalisation gives every sample of a group (and its ReMax greedy episode) the one scale its group
first met: the statistics move with every server batch, and a group's samples are scored in
several, so group-mates scaled apart would change their group's advantages (the group estimators
only cancel one shared affine map). Groups of other workers, and later groups, have their own.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import trio

from asyncrl.contract import Episode, EpisodeContext
from asyncrl.recipe import Recipe, RewardModelConfig
from asyncrl.rewards import RewardResult, RewardRunner, ScoresEpisodes, load_reward
from asyncrl.served.server_batches import BatchedServers, require_urls

# --------------------------------------------------------------------------------------------------
# Normalisation (pure)
# --------------------------------------------------------------------------------------------------


@dataclass
class ScoreNorm:
    """Raw score -> normalised score. ``running`` keeps Welford's mean and variance of what it saw."""

    kind: str = "none"  # none | fixed | running
    shift: float = 0.0
    scale: float = 1.0
    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def update(self, scores: list[float]) -> None:
        if self.kind != "running":
            return
        for x in scores:
            self.count += 1
            d = x - self.mean
            self.mean += d / self.count
            self.m2 += d * (x - self.mean)

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else 1.0

    def affine(self) -> tuple[float, float]:
        """(shift, scale) of the affine map x -> (x - shift) / scale as things stand: what a group
        keeps for all its samples (:class:`ModelReward`)."""
        if self.kind == "fixed":
            return self.shift, self.scale
        if self.kind == "running" and self.count > 1:
            return self.mean, max(self.std, 1e-6)
        return 0.0, 1.0

    def __call__(self, x: float) -> float:
        shift, scale = self.affine()
        return (x - shift) / scale


GROUP_SCALES_KEPT = 4096
"""Groups whose scale a :class:`ModelReward` remembers, the most recently used; far more than a
worker has in flight (``rollout.max_concurrent_groups``)."""

_GROUP: ContextVar[str | None] = ContextVar("asyncrl_reward_group", default=None)
"""The group of the episode being scored (:meth:`CombinedReward.score_episode`)."""


def group_of(rid: str) -> str:
    """The group of an episode's request id prefix, ``<group id>/<episode>`` (or ``/greedy``)."""
    return rid.rsplit("/", 1)[0]


def parse_scores(body: Any, n: int) -> list[float]:
    """The first label's score of each of ``n`` items of a /classify answer (SGLang's shape:
    ``[{"embedding": [s, ...], "meta_info": ...}, ...]``). ValueError naming what is wrong."""
    items = body if isinstance(body, list) else [body]
    if len(items) != n:
        raise ValueError(f"{len(items)} results for {n} inputs")
    out = []
    for i, it in enumerate(items):
        emb = it.get("embedding") if isinstance(it, dict) else None
        if not isinstance(emb, list) or not emb or not isinstance(emb[0], int | float):
            raise ValueError(f"result {i} has no embedding score")
        v = float(emb[0])
        if not math.isfinite(v):
            raise ValueError(f"result {i}: score {v} is not finite")
        out.append(v)
    return out


# --------------------------------------------------------------------------------------------------
# The service client
# --------------------------------------------------------------------------------------------------


class ModelReward(BatchedServers[float]):
    """Scores completions on the ``/classify`` servers of ``rollout.reward_model``."""

    def __init__(self, cfg: RewardModelConfig) -> None:
        super().__init__(cfg.urls, timeout_s=cfg.timeout_s, batch_size=cfg.batch_size)
        self.cfg = cfg
        self.norm = ScoreNorm(cfg.normalize, cfg.shift, cfg.scale)
        self.groups: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def request(self, payloads: list) -> tuple[str, dict]:
        return "/classify", {"input_ids" if self.cfg.input == "ids" else "text": payloads}

    def parse(self, answer, payloads: list) -> list[float]:
        return parse_scores(answer, len(payloads))

    def accept(self, results: list[float]) -> list[float]:
        self.norm.update(results)  # raw scores go on: each is normalised by its group's scale
        return results

    def scale_of(self, group: str | None) -> tuple[float, float]:
        """The group's (shift, scale): the one it first met, kept for its other samples."""
        if group is None:
            return self.norm.affine()
        if group in self.groups:
            self.groups.move_to_end(group)
        else:
            self.groups[group] = self.norm.affine()
            if len(self.groups) > GROUP_SCALES_KEPT:
                self.groups.popitem(last=False)
        return self.groups[group]

    async def score(self, payload: list[int] | str, group: str | None = None) -> tuple[float, str]:
        """(normalised score, failure), normalised with ``group``'s scale (None: as things stand
        now); never raises but for cancellation."""
        value, failure = await self.call(payload)
        if value is None:
            return 0.0, failure
        shift, scale = self.scale_of(group)
        return (value - shift) / scale, failure


# --------------------------------------------------------------------------------------------------
# Rule + model
# --------------------------------------------------------------------------------------------------


class CombinedReward(ScoresEpisodes):
    """``rule_weight · rule + model_weight · model`` with :class:`RewardRunner`'s ``score``: a
    failed part fails the sum, its failure recorded (both parts' when both fail)."""

    def __init__(
        self,
        rule: RewardRunner | None,
        model: ModelReward,
        *,
        rule_weight: float = 1.0,
        model_weight: float = 1.0,
        answer_key: str = "answer",
    ) -> None:
        self.rule, self.model = rule, model
        self.rule_weight, self.model_weight = rule_weight, model_weight
        self.answer_key = answer_key
        self.stats = model.stats

    async def score_episode(self, ctx: EpisodeContext, ep: Episode) -> RewardResult:
        """:meth:`ScoresEpisodes.score_episode`, the model's score normalised with the scale of
        the episode's group (``ctx.rid``'s group id; the ReMax greedy episode's is its group's)."""
        token = _GROUP.set(group_of(ctx.rid))
        try:
            return await super().score_episode(ctx, ep)
        finally:
            _GROUP.reset(token)

    async def score(
        self,
        *,
        prompt: str,
        completion: str | None,
        prompt_ids: list[int],
        completion_ids: list[int],
        row: dict[str, Any],
        extra: dict[str, Any] | None = None,
        decode: Callable[[list[int]], str] | None = None,
    ) -> RewardResult:
        t0 = trio.current_time()
        parts: dict[str, tuple[float, str]] = {}
        group = _GROUP.get()

        async def rule() -> None:
            assert self.rule is not None
            r = await self.rule.score(
                prompt=prompt,
                completion=completion,
                prompt_ids=prompt_ids,
                completion_ids=completion_ids,
                row=row,
                extra=extra,
                decode=decode,
            )
            parts["rule"] = (r.value, r.failure)

        async def model() -> None:
            if self.model.cfg.input == "ids":
                payload: list[int] | str = list(prompt_ids) + list(completion_ids)
            else:
                text = completion
                if text is None:
                    assert decode is not None
                    text = await trio.to_thread.run_sync(decode, completion_ids)
                payload = prompt + text
            parts["model"] = await self.model.score(payload, group)

        async with trio.open_nursery() as n:
            if self.rule is not None:
                n.start_soon(rule)
            n.start_soon(model)
        value = 0.0
        failures = []
        for name, weight in (("rule", self.rule_weight), ("model", self.model_weight)):
            if name in parts:
                v, failure = parts[name]
                value += weight * v
                if failure:
                    failures.append(f"{name}: {failure}")
        return RewardResult(
            value=value, failure="; ".join(failures), seconds=trio.current_time() - t0
        )


def build_reward(r: Recipe) -> RewardRunner | CombinedReward:
    """The recipe's reward: ``rollout.reward`` alone, plus the reward model when it has servers
    (``rollout.reward: model``: the reward model alone).

    RecipeError when the reward model has a ``path`` but no ``urls`` (:func:`require_urls`)."""
    ro = r.rollout
    rm = ro.reward_model
    require_urls("rollout.reward_model", rm.path, rm.urls, "the /classify servers")
    rule = None
    if ro.reward != "model":
        rule = RewardRunner(
            load_reward(ro.reward), timeout_s=ro.reward_timeout_s, answer_key=r.data.answer_key
        )
    if not ro.reward_model.enabled:
        assert rule is not None  # the recipe's validation: reward model needs urls
        return rule
    return CombinedReward(
        rule,
        ModelReward(ro.reward_model),
        rule_weight=ro.reward_weight,
        model_weight=ro.reward_model.weight,
        answer_key=r.data.answer_key,
    )


Reward = RewardRunner | CombinedReward
"""What a rollout scores samples with (:func:`build_reward`)."""
