"""Held-out evaluation through the generators: the recipe's prompts, chat template, stop rules,
workflow and reward, decoded greedily (docs/design.md §6).

It runs the same path as a rollout (render the prompt, ``workflow.run_episode``, the reward
function) with temperature 0 and one sample per prompt, so a held-out score means what the training
reward means. The learner evaluates a version while its generators hold it
(:mod:`asyncrl.learner.eval_schedule`); :mod:`asyncrl.evaluate` evaluates an export on a built-in
engine of its own. Every token's version is checked: a sample with a token of another version is
not scored (counted in ``other_version``), so a score is always the score of one version.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import trio

from asyncrl import metric_names as names
from asyncrl.agents.tool_envs import ToolSet
from asyncrl.agents.tools import ToolRegistry
from asyncrl.contract import EpisodeContext, Workflow
from asyncrl.control import ControlPlane
from asyncrl.generator_http import GeneratorError
from asyncrl.recipe import Recipe
from asyncrl.rewards import RewardRunner, load_reward
from asyncrl.rollout.generator_pool import Batcher, GeneratorPool
from asyncrl.rollout.prompts import load_prompt_rows, render_prompt
from asyncrl.rollout.sglang_protocol import SamplingParams
from asyncrl.rollout.workflows import gives_tools, load_workflow, play
from asyncrl.served.model_reward import Reward, build_reward

log = logging.getLogger(__name__)

BATCH = 16
"""Prompts whose first requests go to a generator as one HTTP call (as a group's episodes do)."""

EXAMPLES = 5
"""(prompt, answer, completion) triples a report keeps, for the log."""

DOWN_S = 10.0
"""An evaluation stops once every one of its generators has failed for this long. The broadcaster
sends no version while it runs: waiting (up to ``rollout.request_timeout_s``) for a generator that
died would hold back the weights of the one that replaced it, and its worker, waiting for them,
would hold back the learner's data."""


@dataclass(kw_only=True)
class EvalReport:
    """One evaluation of one version."""

    version: int  # the weights every scored token came from
    score: float  # mean reward over the prompts (exact_match: the fraction solved)
    prompts: int
    failed: int = 0  # generation or reward failures (scored 0)
    other_version: int = 0  # samples with a token of another version (scored 0)
    tokens: int = 0
    seconds: float = 0.0
    examples: list[dict[str, str]] = field(default_factory=list)
    with_tools: bool = False  # the recipe gives its episodes tools: tool_call_rate is measured
    tool_call_episodes: int = 0  # episodes with at least one valid tool call (the tool answered)

    @property
    def tool_call_rate(self) -> float | None:
        """The fraction of prompts whose episode made at least one valid tool call (a call the
        tool answered without an error; a failed prompt made none); None without tools."""
        return self.tool_call_episodes / max(self.prompts, 1) if self.with_tools else None

    def metrics(self) -> dict[str, float]:
        """The ``eval/*`` values, logged at step = the version evaluated."""
        out = {
            names.EVAL_SUCCESS: self.score,
            "eval/prompts": self.prompts,
            "eval/failed": self.failed,
            "eval/other_version": self.other_version,
            "eval/seconds": self.seconds,
            "eval/tokens_per_s": self.tokens / self.seconds if self.seconds > 0 else 0.0,
        }
        if self.tool_call_rate is not None:
            out[names.EVAL_TOOL_CALL_RATE] = self.tool_call_rate
        return out


def eval_rows(r: Recipe) -> list[dict[str, Any]]:
    """The first ``run.eval_prompts`` rows of ``data.eval_path`` ([] without one, or with
    ``eval_prompts: 0``); malformed rows are reported and skipped as in training data."""
    n = r.run.eval_prompts
    if not n or not r.data.eval_path:
        return []
    ds, _, _ = load_prompt_rows(r.resolve(r.data.eval_path), prompt_key=r.data.prompt_key)
    return [dict(ds[i]) for i in range(min(n, len(ds)))]


def eval_reward(r: Recipe) -> Reward:
    """The held-out reward: ``rollout.eval_reward``'s rule against the data's answers when set (a
    policy trained on a reward model alone is judged by the ground truth, not by the model it
    optimises), else the rollouts' own (:func:`build_reward`)."""
    ro = r.rollout
    if not ro.eval_reward:
        return build_reward(r)
    return RewardRunner(
        load_reward(ro.eval_reward), timeout_s=ro.reward_timeout_s, answer_key=r.data.answer_key
    )


async def _stop_when_down(pool: GeneratorPool, scope: trio.CancelScope, why: list[str]) -> None:
    """Cancel ``scope`` once every generator has failed for :data:`DOWN_S`, saying why."""
    while pool.down_s() < DOWN_S:
        await trio.sleep(min(1.0, DOWN_S / 4))
    why.append(f"every generator down for {DOWN_S:g} s ({pool.errors()})")
    scope.cancel()


@dataclass(kw_only=True)
class Evaluation:
    """What an evaluation needs besides the generators, built once from the recipe."""

    rows: list[dict[str, Any]]
    tokenizer: Any
    workflow: Workflow
    reward: Reward
    params: SamplingParams  # the recipe's, at temperature 0
    tools: ToolRegistry
    tool_set: ToolSet | None = None  # the recipe's tools with its MCP servers
    prompt_key: str = "prompt"
    chat_template: bool = False
    max_turns: int = 1
    request_timeout_s: float = 600.0
    lora: bool = False  # SGLang serves LoRA versions as named adapters (GeneratorPool's lora)

    @classmethod
    def from_recipe(cls, r: Recipe, *, tokenizer: Any = None) -> Evaluation | None:
        """None when the recipe has no held-out prompts."""
        rows = eval_rows(r)
        if not rows:
            return None
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(r.resolve(r.model.path))
        ro = r.rollout
        tool_set = ToolSet.from_specs(ro.tools, timeout_s=ro.tool_timeout_s)
        return cls(
            rows=rows,
            tokenizer=tokenizer,
            workflow=load_workflow(ro.workflow),
            reward=eval_reward(r),
            params=dataclasses.replace(SamplingParams.from_recipe(ro), temperature=0.0),
            tools=tool_set.registry,
            tool_set=tool_set,
            prompt_key=r.data.prompt_key,
            chat_template=r.data.chat_template,
            max_turns=ro.max_turns,
            request_timeout_s=ro.request_timeout_s,
            lora=r.learner.lora.enabled and r.generator.kind == "sglang",
        )

    @property
    def with_tools(self) -> bool:
        return gives_tools(self.workflow, self.tools, self.tool_set)

    def run(self, urls: list[str], *, version: int, timeout_s: float) -> EvalReport:
        """Evaluate ``version`` on the generators at ``urls`` that hold it, from blocking code (``python
        -m asyncrl.evaluate``, an SFT run's ends): on a :class:`ControlPlane` of its own, the one way
        blocking code enters trio here; the learner runs :meth:`arun` on its own plane's loop.
        Raises ``trio.TooSlowError`` after ``timeout_s``."""
        plane = ControlPlane("evaluation")
        try:
            return plane.run(
                functools.partial(self.arun, urls, version=version, timeout_s=timeout_s)
            )
        finally:
            plane.close()

    async def arun(self, urls: list[str], *, version: int, timeout_s: float) -> EvalReport:
        t0 = time.monotonic()
        report = EvalReport(
            version=version, score=0.0, prompts=len(self.rows), with_tools=self.with_tools
        )
        scores = [0.0] * len(self.rows)
        rendered = await trio.to_thread.run_sync(self._render_all, await self._schemas())
        with trio.fail_after(timeout_s):
            async with GeneratorPool(
                urls, timeout_s=self.request_timeout_s, lora=self.lora
            ) as pool:
                pool.min_version = version  # a generator behind it is not asked
                await pool.refresh_versions()
                if not pool.any_eligible():  # not waited for: the caller holds the version
                    raise GeneratorError(f"no generator holds version {version}: {pool.behind()}")
                down: list[str] = []
                async with trio.open_nursery() as watched:
                    watched.start_soon(_stop_when_down, pool, watched.cancel_scope, down)
                    async with trio.open_nursery() as nursery:
                        for start in range(0, len(self.rows), BATCH):
                            batcher = Batcher()
                            for i in range(start, min(start + BATCH, len(self.rows))):
                                nursery.start_soon(
                                    self._one, pool, batcher, i, rendered[i], scores, report
                                )
                    watched.cancel_scope.cancel()  # every prompt is done
                if down:
                    raise GeneratorError(down[0])
        report.score = sum(scores) / max(len(scores), 1)
        report.seconds = time.monotonic() - t0
        return report

    async def _schemas(self) -> list[dict[str, Any]] | Exception:
        """The tools the chat template shows (an MCP server's as it lists them), or why not."""
        if not self.chat_template:
            return []
        try:
            if self.tool_set is not None:
                return await self.tool_set.schemas()
            return self.tools.schemas()
        except Exception as e:  # every prompt fails with it, scored 0
            return e

    def _render_all(
        self, tools: list[dict[str, Any]] | Exception
    ) -> list[tuple[str, list[int]] | Exception]:
        out: list[tuple[str, list[int]] | Exception] = []
        for row in self.rows:
            if isinstance(tools, Exception):
                out.append(tools)
                continue
            try:
                out.append(
                    render_prompt(
                        row,
                        self.tokenizer,
                        prompt_key=self.prompt_key,
                        chat_template=self.chat_template,
                        tools=tools or None,
                    )
                )
            except Exception as e:  # reported per prompt, scored 0
                out.append(e)
        return out

    async def _one(
        self,
        pool: GeneratorPool,
        batcher: Batcher,
        i: int,
        rendered: tuple[str, list[int]] | Exception,
        scores: list[float],
        report: EvalReport,
    ) -> None:
        """Prompt ``i``: one greedy episode and its reward into ``scores[i]`` (0 if it fails)."""
        row = self.rows[i]
        try:
            if isinstance(rendered, Exception):
                raise rendered
            text, ids = rendered
            ctx = EpisodeContext(
                prompt_ids=list(ids),
                prompt_text=text,
                row=row,
                pool=pool,
                params=self.params,
                tokenizer=self.tokenizer,
                tools=self.tools,
                max_turns=self.max_turns,
                rid=f"eval-{report.version}-{i}",
                batcher=batcher,
                tool_set=self.tool_set,
                chat_template=self.chat_template,
            )
            ep = await play(self.workflow, ctx)
        except Exception as e:  # one prompt's failure is a 0, never the whole evaluation
            report.failed += 1
            log.warning("held-out prompt %d failed: %s: %s", i, type(e).__name__, e)
            return
        report.tokens += len(ep.completion_ids)
        report.tool_call_episodes += ep.made_tool_call
        if any(v != report.version for v in ep.versions):
            report.other_version += 1
            return
        r = await self.reward.score_episode(ctx, ep)
        if r.failure:
            report.failed += 1
        scores[i] = r.value
        if len(report.examples) < EXAMPLES:
            report.examples.append(
                {
                    "prompt": text,
                    "answer": str(row.get(self.reward.answer_key, "")),
                    "completion": self.tokenizer.decode(
                        ep.completion_ids, skip_special_tokens=True
                    ),
                }
            )
