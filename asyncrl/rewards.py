"""Rewards: exact match, math answers with math-verify, and user functions (docs/design.md §6).

A reward function is called as ``fn(prompt, completion, prompt_ids, completion_ids, **row)``: the
prompt and completion as text, their token ids, and every field of the dataset row (plus ``answer``
taken from the recipe's ``data.answer_key`` and the sample's ``finish_reason``). It returns a number
(``bool`` counts as 0/1) and may be ``async``.

Rewards run off the event loop (a thread, under a limiter) within ``timeout_s``. A reward that raises,
times out, or returns something that is not a finite number is a failure, never a crash: the result
says why (``RewardResult.failure``, its ``value`` a placeholder 0 that is no reward), and a line is
logged at most once a minute per reward. A rollout leaves that sample out of its group rather than
train on the 0 (:mod:`asyncrl.rollout.group_maker`); the held-out evaluation counts it as failed. A
timed-out thread cannot be killed; it is abandoned and counted (``stats["abandoned"]``) and holds its
limiter slot until it ends.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from asyncrl import tasks
from asyncrl.contract import RewardFn  # here too: plugins import it from here
from asyncrl.plugins import PluginError, load_object
from asyncrl.progress import Throttle

if TYPE_CHECKING:
    from asyncrl.contract import Episode, EpisodeContext

log = logging.getLogger(__name__)

_RESERVED = ("prompt", "completion", "prompt_ids", "completion_ids")


# --------------------------------------------------------------------------------------------------
# Built-in rewards
# --------------------------------------------------------------------------------------------------


def exact_match(
    prompt: str,
    completion: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    *,
    answer: Any = None,
    finish_reason: str = "stop",
    **row: Any,
) -> float:
    """1 if the completion equals the answer (surrounding whitespace ignored) and the policy ended it
    itself (finish ``stop``: EOS or a stop string, as the held-out evaluation scores); else 0."""
    if answer is None:
        raise ValueError("exact_match needs an 'answer' field in the data row (data.answer_key)")
    if finish_reason != "stop":
        return 0.0
    return tasks.score(completion, str(answer))


def math_verify_reward(
    prompt: str,
    completion: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    *,
    answer: Any = None,
    **row: Any,
) -> float:
    """1 if math-verify finds the completion's final answer equal to the reference answer, else 0.

    math-verify's own timeouts use SIGALRM, which only works on the main thread; they are off here,
    and the runner's timeout bounds the call instead.
    """
    from math_verify import parse, verify

    if answer is None:
        raise ValueError("math needs an 'answer' field in the data row (data.answer_key)")
    gold_text = str(answer)
    if "$" not in gold_text and "\\boxed" not in gold_text:
        gold_text = f"${gold_text}$"
    gold = parse(gold_text, parsing_timeout=None)
    pred = parse(completion, parsing_timeout=None)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0


for _name in ("math_verify.parser", "math_verify.grader"):  # "timeout is disabled" on every call
    logging.getLogger(_name).setLevel(logging.ERROR)

BUILTIN_REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "math": math_verify_reward}


def load_reward(spec: str) -> RewardFn:
    """A built-in name or ``module:function`` from the recipe's ``rollout.reward``."""
    fn = load_object(spec, key="rollout.reward", builtins=BUILTIN_REWARDS)
    if not callable(fn):
        raise PluginError(f"rollout.reward: {spec!r} is not a function")
    return fn


# --------------------------------------------------------------------------------------------------
# Running them
# --------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class RewardResult:
    value: float  # 0 when it failed: not a reward, never to be trained on
    failure: str = ""  # empty when the reward ran fine
    seconds: float = 0.0


class ScoresEpisodes:
    """What :class:`RewardRunner` and the rule + model reward share: scoring one played episode
    through their ``score`` (the one way a rollout and a held-out evaluation score)."""

    stats: dict[str, int]

    async def score(self, **kwargs: Any) -> RewardResult:
        raise NotImplementedError

    async def score_episode(self, ctx: EpisodeContext, ep: Episode) -> RewardResult:
        """The reward of one episode of ``ctx``'s prompt (the completion decoded in the reward's
        thread). A workflow that gave its episode a reward (``ep.reward``, e.g. an agent's) is
        scored by it instead."""
        if ep.reward is not None:
            value = float(ep.reward)
            if math.isfinite(value):
                return RewardResult(value=value)
            self.stats["failures"] = self.stats.get("failures", 0) + 1
            return RewardResult(value=0.0, failure=f"the workflow's reward is {value}, not finite")
        tok = ctx.tokenizer
        return await self.score(
            prompt=ctx.prompt_text,
            completion=None,
            prompt_ids=list(ctx.prompt_ids if ep.prompt_ids is None else ep.prompt_ids),
            completion_ids=list(ep.completion_ids),
            row=ctx.row,
            extra={"finish_reason": ep.finish_reason},
            decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
        )


class RewardRunner(ScoresEpisodes):
    """Runs one reward function with a timeout, off the event loop; a failure is a result with a
    reason, not an exception."""

    def __init__(
        self,
        fn: RewardFn,
        *,
        timeout_s: float,
        max_threads: int = 8,
        answer_key: str = "answer",
    ) -> None:
        self.fn = fn
        self.timeout_s = timeout_s
        self.answer_key = answer_key
        self.is_async = inspect.iscoroutinefunction(fn)
        self.limiter = trio.CapacityLimiter(max_threads)
        self.stats = {"calls": 0, "failures": 0, "timeouts": 0, "abandoned": 0}
        self.name = getattr(fn, "__qualname__", repr(fn))
        self._quiet = Throttle(log)  # a reward failing on every sample: a line a minute

    def _kwargs(self, row: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
        kw = {k: v for k, v in row.items() if k not in _RESERVED}
        if "answer" not in kw and self.answer_key in row:
            kw["answer"] = row[self.answer_key]
        kw.update(extra)
        return kw

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
        """Never raises (except cancellation): a failure is a result with a reason (value 0).

        With ``completion=None``, ``decode(completion_ids)`` makes the text in the same thread as
        the reward (one thread hop per sample instead of two).
        """
        self.stats["calls"] += 1
        kw = self._kwargs(row, extra or {})
        fn = self.fn

        def text() -> str:
            if completion is not None:
                return completion
            if decode is None:
                raise TypeError("score() needs the completion text or a decode function")
            return decode(completion_ids)

        if self.is_async:

            async def call() -> Any:
                t = await trio.to_thread.run_sync(text)
                return await fn(prompt, t, prompt_ids, completion_ids, **kw)
        else:

            def call() -> Any:
                return fn(prompt, text(), prompt_ids, completion_ids, **kw)

        t0 = trio.current_time()
        value: Any = None
        failure = ""
        timed_out = True
        try:
            with trio.move_on_after(self.timeout_s):
                if self.is_async:
                    value = await call()
                else:
                    value = await trio.to_thread.run_sync(
                        call, abandon_on_cancel=True, limiter=self.limiter
                    )
                timed_out = False
        except Exception as e:  # the user's reward raised: recorded, never a crash
            timed_out = False
            failure = f"raised {type(e).__name__}: {e}"[:500]
        if timed_out:
            self.stats["timeouts"] += 1
            if not self.is_async:
                self.stats["abandoned"] += 1
            failure = f"timed out after {self.timeout_s:g}s"
        elif not failure:
            try:
                value = float(value)  # bool, int, numpy scalars, 0-d tensors
            except (TypeError, ValueError):
                failure = f"returned {type(value).__name__}, not a number"
            else:
                if not math.isfinite(value):
                    failure = f"returned {value}, not a finite number"
        seconds = trio.current_time() - t0
        if failure:
            self.stats["failures"] += 1
            self._quiet.warning("failure", "reward %s: %s", self.name, failure)
            return RewardResult(value=0.0, failure=failure, seconds=seconds)
        return RewardResult(value=value, seconds=seconds)
