"""Group production: one prompt → ``group_size`` episodes run concurrently by the workflow → rewards →
one whole ``wire.Group``. No buffer here: the worker decides when a group may start, and the
sender delivers it.

With ``WorkerConfig.greedy_baseline`` (ReMax) each group also plays one greedy episode of its
prompt (temperature 0, the recipe's other sampling parameters), concurrently with the sampled ones
and through the same workflow and reward: its reward is ``Group.baseline_reward``; its tokens are
counted (they cost generation time) but are no sample. If that episode or its reward fails, the
group goes without a baseline (``None``, the reason in its metadata, counted in
``remax_baseline_failures``) and the learner uses the group's mean reward: its sampled episodes are
as good as any, and a failed reward's 0 would be a wrong baseline, not a missing one.

A sampled episode whose reward failed (raised, timed out, not a finite number: a
:class:`~asyncrl.rewards.RewardResult` with a ``failure``) has no reward, and a 0 in its place
would enter the group's baseline and the critic's targets as if it were one. So it leaves the group
(counted in ``reward_failures``, logged at most once a minute): the group is sent with the others,
whose advantages are then computed over them alone. A group left with fewer than
:func:`min_scored` episodes (2, or 1 with a greedy baseline) has nothing to compare them with and
is dropped (:class:`RewardsFailed`; the worker counts and logs it, and counts its prompt as used).

With a teacher (``rollout.teacher``, :mod:`asyncrl.served.teacher`) each scored episode also gets
the teacher's logprobs of its completion tokens (``Sample.teacher_logprobs``), asked beside its
reward. An episode whose teacher logprobs could not be had is a failure of its scoring, left out of
its group as a failed reward is (its failure says ``teacher: ...``)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from asyncrl import wire
from asyncrl.agents.tool_envs import ToolSet
from asyncrl.agents.tools import ToolRegistry
from asyncrl.contract import Episode, EpisodeContext, Tool, Workflow
from asyncrl.moe import fit_routes
from asyncrl.progress import Throttle
from asyncrl.rollout.generator_pool import Batcher, GeneratorPool
from asyncrl.rollout.prompts import PromptItem, PromptSource, render_prompt
from asyncrl.rollout.sglang_protocol import SamplingParams
from asyncrl.rollout.turns import split_turns
from asyncrl.rollout.workflows import gives_tools, play
from asyncrl.served.model_reward import Reward
from asyncrl.served.teacher import TeacherLogprobs

if TYPE_CHECKING:
    from asyncrl.rollout.worker_config import WorkerConfig
    from asyncrl.rollout.worker_stats import WorkerStats

log = logging.getLogger("asyncrl.rollout.worker")  # one logger for the worker's parts


def routes_of(ep: Episode, prompt_len: int) -> dict[str, np.ndarray]:
    """The sample's ``routed_experts``, over its tokens but the last, when the episode recorded
    routes (routing replay); else nothing (the field's default, none)."""
    n = max(prompt_len + len(ep.completion_ids) - 1, 0)
    routes = fit_routes(ep.routed_experts, n)
    return {} if routes is None else {"routed_experts": routes}


class PromptsUnusable(RuntimeError):
    """Too many prompts in a row could not be rendered."""


class RewardsFailed(RuntimeError):
    """Too few of a group's rewards could be computed to train on it (module docstring)."""


def min_scored(group_size: int, *, baseline: bool = False) -> int:
    """Episodes with a reward a group needs: 2, one compared with the others (the group estimators
    give a group of one a zero advantage); 1 when it has ReMax's greedy ``baseline`` to compare
    with, or when groups are of one sample (whose advantage comes from a critic)."""
    return 1 if baseline else min(2, group_size)


@dataclass
class Prompt:
    """A dataset row rendered for the model."""

    item: PromptItem
    text: str
    ids: list[int]


@dataclass
class _Greedy:
    """What a group's greedy episode gave: its reward, or why there is none."""

    reward: float | None = None
    failure: str = ""


class GroupMaker:
    """Makes groups; counts episodes, tokens, rewards and skipped prompts in ``stats``."""

    def __init__(
        self,
        config: WorkerConfig,
        *,
        pool: GeneratorPool,
        source: PromptSource,
        tokenizer: Any,
        workflow: Workflow,
        reward: Reward,
        params: SamplingParams,
        tools: ToolRegistry,
        max_turns: int,
        stats: WorkerStats,
        tool_set: ToolSet | None = None,
        teacher: TeacherLogprobs | None = None,
    ) -> None:
        self.cfg = config
        self.teacher = teacher
        self.pool = pool
        self.source = source
        self.tokenizer = tokenizer
        self.workflow = workflow
        self.reward = reward
        self.params = params
        self.tools = tools
        self.tool_set = tool_set
        self.max_turns = max_turns
        self.stats = stats
        self.greedy_params = dataclasses.replace(params, temperature=0.0)
        self.episodes_in_flight = 0
        self.with_tools = gives_tools(workflow, tools, tool_set)  # a tool-call rate is measured
        self._quiet = Throttle(log)  # a reward that keeps failing: a line a minute, with a count

    async def _tool_schemas(self) -> list[dict]:
        """What the chat template shows the model: the workflow's own tools, else the recipe's
        (an MCP server's, as it lists them)."""
        own = getattr(self.workflow, "tools", None)
        if isinstance(own, list) and own and all(isinstance(t, Tool) for t in own):
            return [t.schema() for t in own]
        if self.tool_set is not None:
            return await self.tool_set.schemas()
        return self.tools.schemas()

    async def take_prompt(self) -> Prompt:
        """The next usable prompt; rows that cannot be rendered are reported and skipped."""
        tools = (await self._tool_schemas()) if self.cfg.chat_template else []
        for _ in range(1000):
            item = self.source.take()
            try:
                render = functools.partial(
                    render_prompt,
                    item.row,
                    self.tokenizer,
                    prompt_key=self.cfg.prompt_key,
                    chat_template=self.cfg.chat_template,
                    tools=tools or None,
                )
                text, ids = await trio.to_thread.run_sync(render)
                if self.cfg.max_prompt_tokens and len(ids) > self.cfg.max_prompt_tokens:
                    raise ValueError(
                        f"the prompt has {len(ids)} tokens, over {self.cfg.max_prompt_tokens}"
                    )
            except Exception as e:
                self.stats.counters["prompts_skipped"] += 1
                self.source.done(item.index)
                log.warning("skipping a malformed row: %s: %s", item.where, e)
                continue
            return Prompt(item, text, ids)
        raise PromptsUnusable("1000 prompts in a row could not be rendered")

    async def make(self, group_id: str, lease_id: str, prompt: Prompt) -> wire.Group:
        """``group_size`` episodes of ``prompt``, each with its reward, as one group (and with
        ``greedy_baseline``, the greedy episode's reward as its ``baseline_reward``)."""
        n = self.cfg.group_size
        samples: list[list[wire.Sample]] = [[] for _ in range(n)]  # an episode's (or its turns')
        failures = [""] * n  # why an episode's reward failed
        greedy = _Greedy()
        batcher = Batcher()  # the n episodes' first requests go to the generator as one
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(self._episode, group_id, i, prompt, samples, failures, batcher)
            if self.cfg.greedy_baseline:
                nursery.start_soon(self._greedy_episode, group_id, prompt, greedy, batcher)
        failed = [f for f in failures if f]
        if n - len(failed) < min_scored(n, baseline=greedy.reward is not None):
            raise RewardsFailed(
                f"{len(failed)} of {n} rewards failed, too few left to compare (first: {failed[0]})"
            )
        meta: dict[str, Any] = {"worker_id": self.cfg.worker_id, "prompt": prompt.item.where}
        if greedy.failure:
            meta["remax_baseline_failure"] = greedy.failure
        if failed:
            meta["reward_failures"] = len(failed)  # samples left out of the group
        return wire.Group(
            id=group_id,
            lease_id=lease_id,
            samples=[s for i, episode in enumerate(samples) if not failures[i] for s in episode],
            prompt_index=prompt.item.index,
            baseline_reward=greedy.reward,
            metadata=meta,
        )

    def _context(
        self, rid: str, prompt: Prompt, batcher: Batcher, params: SamplingParams
    ) -> EpisodeContext:
        return EpisodeContext(
            prompt_ids=list(prompt.ids),
            prompt_text=prompt.text,
            row=prompt.item.row,
            pool=self.pool,
            params=params,
            tokenizer=self.tokenizer,
            tools=self.tools,
            max_turns=self.max_turns,
            rid=rid,
            batcher=batcher,
            tool_set=self.tool_set,
            chat_template=self.cfg.chat_template,
        )

    async def _greedy_episode(
        self, group_id: str, prompt: Prompt, out: _Greedy, batcher: Batcher
    ) -> None:
        """ReMax's baseline: the reward of the prompt's greedy completion (module docstring)."""
        ctx = self._context(f"{group_id}/greedy", prompt, batcher, self.greedy_params)
        c = self.stats.counters
        try:
            ep = await play(self.workflow, ctx)
        except Exception as e:  # the group's samples stand; it goes without a baseline
            out.failure = f"episode: {type(e).__name__}: {e}"[:500]
        else:
            c["greedy_tokens_generated"] += sum(ep.loss_mask)
            r = await self.reward.score_episode(ctx, ep)
            if r.failure:
                out.failure = f"reward: {r.failure}"
            else:
                out.reward = r.value
                self.stats.greedy_rewards.append(r.value)
        if out.failure:
            c["remax_baseline_failures"] += 1
            log.warning("group %s has no ReMax baseline: %s", group_id, out.failure)

    async def _episode(
        self,
        group_id: str,
        i: int,
        prompt: Prompt,
        out: list[list[wire.Sample]],
        failures: list[str],
        batcher: Batcher,
    ) -> None:
        ctx = self._context(f"{group_id}/{i}", prompt, batcher, self.params)
        self.episodes_in_flight += 1
        s = self.stats
        s.peak_episodes_in_flight = max(s.peak_episodes_in_flight, self.episodes_in_flight)
        try:
            ep = await play(self.workflow, ctx)
        finally:
            self.episodes_in_flight -= 1
        c = self.stats.counters
        c["episodes"] += 1
        c["tokens_generated"] += sum(ep.loss_mask)
        c["resumes"] += int(ep.metadata.get("resumes", 0))
        c["tool_call_episodes"] += ep.made_tool_call
        for call in ep.metadata.get("tool_calls", []):
            if isinstance(call, dict):
                c["tool_calls"] += 1
                c["tool_errors"] += not call.get("ok", True)
                c["tool_timeouts"] += bool(call.get("timed_out", False))
        prompt_ids = prompt.ids if ep.prompt_ids is None else ep.prompt_ids
        teacher_lp, teacher_failure = np.zeros(0, np.float32), ""

        async def ask_teacher() -> None:
            nonlocal teacher_lp, teacher_failure
            assert self.teacher is not None
            teacher_lp, teacher_failure = await self.teacher.logprobs(
                list(prompt_ids), list(ep.completion_ids)
            )

        async with trio.open_nursery() as nursery:
            if self.teacher is not None:
                nursery.start_soon(ask_teacher)
            r = await self.reward.score_episode(ctx, ep)
        if teacher_failure and not r.failure:
            r = dataclasses.replace(r, failure=teacher_failure)
        self.stats.lengths.append(len(ep.completion_ids))
        if r.failure:  # no reward: the sample leaves its group (module docstring)
            c["reward_failures"] += 1
            failures[i] = r.failure
            self._quiet.warning(
                "reward_failures",
                "reward failed, sample %s left out of its group: %s",
                f"{group_id}/{i}",
                r.failure,
            )
            return
        self.stats.rewards.append(r.value)
        meta = dict(ep.metadata)
        sample = wire.Sample(
            id=f"{group_id}/{i}",
            group_id=group_id,
            prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
            completion_ids=np.asarray(ep.completion_ids, dtype=np.int32),
            behavior_logprobs=np.asarray(ep.logprobs, dtype=np.float32),
            versions=np.asarray(ep.versions, dtype=np.int32),
            loss_mask=np.asarray(ep.loss_mask, dtype=np.float32),
            reward=r.value,
            finish_reason=ep.finish_reason,
            metadata=meta,
            teacher_logprobs=teacher_lp,
            **routes_of(ep, len(prompt_ids)),
        )
        out[i] = split_turns(sample, self.cfg.turn_discount) if self.cfg.turn_samples else [sample]
