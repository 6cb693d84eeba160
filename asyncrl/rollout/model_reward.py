"""A learned reward model as a reward: completions scored by ``/classify`` servers (SGLang, or the
built-in engine on a sequence-classification folder), in batches, added to the rule reward.

``rollout.reward_model`` (docs/reward-models.md) names the servers. Samples that finish within
:data:`LINGER_S` of each other travel in one request of up to ``batch_size`` completions (as
``input_ids``: prompt + completion, the same tokens the policy produced; or as text for a reward
model with another tokenizer). A request is bounded by ``timeout_s``; one that a server cannot take
(connection, HTTP error, an answer without a finite score) goes to the next server. A batch that no
server scored within the bound fails each of its samples as any reward does
(:mod:`asyncrl.rollout.rewards`): a recorded ``failure``, and a rollout leaves the sample out of its
group (:mod:`asyncrl.rollout.groups`).

The sample's reward is ``reward_weight · rule + weight · normalised score``; ``rollout.reward: model``
leaves the rule out. Normalisation: none, fixed ``(s - shift) / scale``, or running ``(s - mean) /
std`` over the scores this worker has seen (before the first batch: unnormalised).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from asyncrl.generator_http import GeneratorError, acall, async_client
from asyncrl.recipe import Recipe, RecipeError, RewardModelConfig
from asyncrl.rollout.rewards import RewardResult, RewardRunner, ScoresEpisodes, load_reward

LINGER_S = 0.01
"""How long the first sample of a batch waits for others (unless the batch fills first)."""


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


@dataclass(eq=False)
class _Item:
    payload: Any  # token ids or text
    done: trio.Event = field(default_factory=trio.Event)
    score: float = 0.0
    failure: str = ""


@dataclass(eq=False)
class _Batch:
    items: list[_Item] = field(default_factory=list)
    full: trio.Event = field(default_factory=trio.Event)


class ModelReward:
    """Scores completions on the ``/classify`` servers of ``rollout.reward_model``."""

    def __init__(self, cfg: RewardModelConfig) -> None:
        self.cfg = cfg
        self.norm = ScoreNorm(cfg.normalize, cfg.shift, cfg.scale)
        self.stats = {"calls": 0, "failures": 0, "timeouts": 0, "requests": 0}
        self._turn = itertools.count()  # which server a batch tries first, in turn
        self._http: httpx.AsyncClient | None = None
        self._loop: trio.lowlevel.TrioToken | None = None
        self._open: _Batch | None = None  # the batch new samples join

    @property
    def http(self) -> httpx.AsyncClient:
        """A client of the running event loop: its connections cannot outlive it, and the held-out
        evaluation runs one loop per evaluation (the worker one for its life)."""
        token = trio.lowlevel.current_trio_token()
        if self._http is None or self._loop is not token:
            self._http = async_client(self.cfg.timeout_s)
            self._loop = token
        return self._http

    async def score(self, payload: list[int] | str) -> tuple[float, str]:
        """(normalised score, failure); never raises but for cancellation.

        The first sample of a batch leads it: it waits :data:`LINGER_S` (or until the batch is full)
        and sends it, shielded so that the others' scores arrive even if the leader is cancelled."""
        self.stats["calls"] += 1
        item = _Item(payload)
        batch = self._open
        lead = batch is None
        if batch is None:
            batch = self._open = _Batch()
        batch.items.append(item)
        if len(batch.items) >= self.cfg.batch_size:  # full: the next sample starts another
            batch.full.set()
            self._open = None
        if lead:
            with trio.move_on_after(LINGER_S):
                await batch.full.wait()
            if self._open is batch:
                self._open = None
            with trio.CancelScope(shield=True):
                await self._send(batch.items)
        await item.done.wait()
        if item.failure:
            self.stats["failures"] += 1
        return item.score, item.failure

    async def _send(self, batch: list[_Item]) -> None:
        """Score ``batch`` within ``timeout_s``: a server that cannot be reached or answers an error
        passes the batch to the next one (each server once); the last failure fails the batch."""
        key = "input_ids" if self.cfg.input == "ids" else "text"
        body = {key: [it.payload for it in batch]}
        self.stats["requests"] += 1
        failure = ""
        scores: list[float] = []
        with trio.move_on_after(self.cfg.timeout_s) as scope:
            urls = self.cfg.urls
            first = next(self._turn) % len(urls)
            for url in urls[first:] + urls[:first]:
                try:
                    answer = await acall(self.http, url, "POST", "/classify", body)
                    scores = parse_scores(answer, len(batch))
                    failure = ""
                    break
                except GeneratorError as e:
                    if e.timed_out:  # the bound is spent: no time for another server
                        scope.cancel()
                    failure = str(e)[:500]
                except ValueError as e:
                    failure = f"{url}/classify: {e}"[:500]
        if scope.cancelled_caught:
            self.stats["timeouts"] += 1
            failure = f"/classify timed out after {self.cfg.timeout_s:g}s"
        if failure:
            for it in batch:
                it.failure = failure
        else:
            self.norm.update(scores)
            for it, s in zip(batch, scores, strict=True):
                it.score = self.norm(s)
        for it in batch:
            it.done.set()


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

    RecipeError when the reward model has a ``path`` but no ``urls``: `asyncrl run` starts servers on
    the path and passes their urls; a process started alone cannot know them."""
    ro = r.rollout
    if ro.reward_model.path and not ro.reward_model.urls:
        raise RecipeError(
            f"`asyncrl run` starts the /classify servers on rollout.reward_model.path "
            f"({ro.reward_model.path}); started alone, this process needs their urls "
            "(start `asyncrl engine --model PATH` and set rollout.reward_model.urls, "
            "rollout.reward_model.path='')",
            key="rollout.reward_model.urls",
        )
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
