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
std`` over the scores this worker has seen (before the first batch: unnormalised).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

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

    def __call__(self, x: float) -> float:
        if self.kind == "fixed":
            return (x - self.shift) / self.scale
        if self.kind == "running" and self.count > 1:
            return (x - self.mean) / max(self.std, 1e-6)
        return x


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

    def request(self, payloads: list) -> tuple[str, dict]:
        return "/classify", {"input_ids" if self.cfg.input == "ids" else "text": payloads}

    def parse(self, answer, payloads: list) -> list[float]:
        return parse_scores(answer, len(payloads))

    def accept(self, results: list[float]) -> list[float]:
        self.norm.update(results)
        return [self.norm(s) for s in results]

    async def score(self, payload: list[int] | str) -> tuple[float, str]:
        """(normalised score, failure); never raises but for cancellation."""
        value, failure = await self.call(payload)
        return (0.0 if value is None else value), failure


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
            parts["model"] = await self.model.score(payload)

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
