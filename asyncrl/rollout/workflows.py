"""Workflows: how one episode (one sample of a group) is generated (docs/design.md §6).

A workflow owns the loop, as AReaL's ``RolloutWorkflow.arun_episode`` does: it gets an
:class:`EpisodeContext` (the prompt, the generators, the tokenizer, the tools) and returns an
:class:`Episode` (the completion's tokens with one logprob, version and loss-mask entry each).

- :class:`SingleTurn`: one generation.
- :class:`MultiTurn`: generate, parse a tool call, run the tool, append its result with loss_mask 0
  (logprob 0: the policy did not produce it), repeat up to ``max_turns``; one token budget
  (``max_new_tokens``) covers the whole completion, tool results included.
- Users plug in their own by import path (``rollout.workflow: my_module:my_workflow``): an object
  with ``async run_episode(ctx) -> Episode`` (e.g. a configured ``MultiTurn``), a class of such
  objects (made with no arguments), or a bare ``async def episode(ctx) -> Episode``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from asyncrl.rollout.client import Batcher, Completion, GeneratorPool
from asyncrl.rollout.plugins import PluginError, load_object
from asyncrl.rollout.sglang_protocol import SamplingParams
from asyncrl.rollout.tools import Tool, ToolCall, ToolRegistry, parse_tagged_tool_call
from asyncrl.wire import FINISH_REASONS


@dataclass(kw_only=True)
class Episode:
    """One finished completion, before its reward. Per-token lists all have the same length."""

    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    finish_reason: str = "stop"  # stop | length | abort
    metadata: dict[str, Any] = field(default_factory=dict)
    # Set by a workflow that renders its own prompt (the recording client): the sample's prompt
    # instead of ctx.prompt_ids, and its reward instead of the recipe's reward function.
    prompt_ids: list[int] | None = None
    reward: float | None = None

    def add_generated(self, c: Completion) -> None:
        self.completion_ids += c.output_ids
        self.logprobs += c.logprobs
        self.versions += c.versions
        self.loss_mask += [1] * len(c.output_ids)

    def add_external(self, ids: list[int]) -> None:
        """Tokens the policy did not produce (tool output): masked out of the loss."""
        v = self.versions[-1] if self.versions else 0
        self.completion_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [v] * len(ids)
        self.loss_mask += [0] * len(ids)

    def check(self) -> None:
        n = len(self.completion_ids)
        for name in ("logprobs", "versions", "loss_mask"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"episode.{name} has {len(getattr(self, name))} entries, not {n}")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"episode.finish_reason {self.finish_reason!r}")


@dataclass(kw_only=True)
class EpisodeContext:
    """Everything a workflow may use for one episode."""

    prompt_ids: list[int]
    prompt_text: str
    row: dict[str, Any]
    pool: GeneratorPool
    params: SamplingParams
    tokenizer: Any
    tools: ToolRegistry
    max_turns: int
    rid: str  # prefix of this episode's SGLang request ids (its group's id comes first)
    requests: int = 0  # generate calls so far
    batcher: Batcher | None = None  # shared by the group's episodes: same-tick calls go as one

    async def generate(
        self, input_ids: list[int], *, max_new_tokens: int | None = None, **overrides: Any
    ) -> Completion:
        """One completion from the generators with the recipe's sampling (``overrides`` replace
        fields of :class:`SamplingParams`, e.g. ``stop=[...]``)."""
        params = dataclasses.replace(self.params, **overrides) if overrides else self.params
        self.requests += 1
        return await self.pool.generate(
            input_ids,
            params,
            max_new_tokens=max_new_tokens,
            rid=f"{self.rid}.{self.requests}",
            batcher=self.batcher,
        )

    async def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens), off the event loop."""
        return await trio.to_thread.run_sync(
            lambda: list(self.tokenizer.encode(text, add_special_tokens=False))
        )

    async def decode(self, ids: list[int]) -> str:
        return await trio.to_thread.run_sync(
            lambda: self.tokenizer.decode(ids, skip_special_tokens=True)
        )


class Workflow(Protocol):
    async def run_episode(self, ctx: EpisodeContext) -> Episode: ...


async def play(workflow: Workflow, ctx: EpisodeContext) -> Episode:
    """``workflow.run_episode(ctx)``, checked: a workflow is user code, so a malformed episode fails
    here, where the workflow is named, not later in the learner."""
    ep = await workflow.run_episode(ctx)
    if not isinstance(ep, Episode):
        raise TypeError(f"the workflow returned {type(ep).__name__}, not an Episode")
    ep.check()
    return ep


class SingleTurn:
    """One generation from the prompt."""

    async def run_episode(self, ctx: EpisodeContext) -> Episode:
        c = await ctx.generate(ctx.prompt_ids)
        ep = Episode(finish_reason=c.finish_reason)
        ep.add_generated(c)
        ep.metadata["resumes"] = c.num_resumes
        return ep


def tagged_result(call: ToolCall, result: str) -> str:
    """How a tool result is shown to the model (the default of :class:`MultiTurn`)."""
    return f"\n<result>{result}</result>\n"


class MultiTurn:
    """Generate → parse a tool call → run it → append its result (loss_mask 0) → repeat.

    ``parse_tool_call(text of this turn) -> ToolCall | None`` (default: ``<tool>{json}</tool>``);
    ``format_result(call, result) -> text`` (default: ``\\n<result>...</result>\\n``). Each turn stops
    at ``stop`` (default ``</tool>``) or after ``turn_max_new_tokens``; the episode ends when a turn
    has no tool call, the budget is spent, or after ``max_turns`` turns.
    """

    def __init__(
        self,
        *,
        tools: list[Tool | Callable[..., Any]] | None = None,
        parse_tool_call: Callable[[str], ToolCall | None] = parse_tagged_tool_call,
        format_result: Callable[[ToolCall, str], str] = tagged_result,
        stop: tuple[str, ...] = ("</tool>",),
        max_turns: int | None = None,
        turn_max_new_tokens: int | None = None,
    ) -> None:
        from asyncrl.rollout.tools import tool_from_function

        self.tools = (
            None
            if tools is None
            else [t if isinstance(t, Tool) else tool_from_function(t) for t in tools]
        )
        self.parse_tool_call = parse_tool_call
        self.format_result = format_result
        self.stop = list(stop)
        self.max_turns = max_turns
        self.turn_max_new_tokens = turn_max_new_tokens

    async def run_episode(self, ctx: EpisodeContext) -> Episode:
        registry = (
            ToolRegistry(self.tools, timeout_s=ctx.tools.timeout_s) if self.tools else ctx.tools
        )
        budget = ctx.params.max_new_tokens
        max_turns = self.max_turns or ctx.max_turns
        stop = list(dict.fromkeys(ctx.params.stop + self.stop))
        ep = Episode()
        calls: list[dict[str, Any]] = []
        for turn in range(max_turns):
            room = budget - len(ep.completion_ids)
            if room <= 0:
                ep.finish_reason = "length"
                break
            limit = min(room, self.turn_max_new_tokens or room)
            c = await ctx.generate(
                ctx.prompt_ids + ep.completion_ids, max_new_tokens=limit, stop=stop
            )
            ep.add_generated(c)
            ep.finish_reason = c.finish_reason
            spent = len(ep.completion_ids) >= budget
            # a turn that stopped (stop string, EOS) or hit its own limit may hold a tool call
            if c.finish_reason == "abort" or spent or turn == max_turns - 1:
                break
            call = self.parse_tool_call(await ctx.decode(c.output_ids))
            if call is None:
                break
            result, ok = await registry.call(call)
            calls.append({"turn": turn, "name": call.name, "ok": ok})
            ids = await ctx.encode(self.format_result(call, result))
            room = budget - len(ep.completion_ids)
            if len(ids) >= room:  # the result does not leave room for another turn
                ep.add_external(ids[:room])
                ep.finish_reason = "length"
                break
            ep.add_external(ids)
        ep.metadata["tool_calls"] = calls
        ep.metadata["turns"] = ctx.requests
        return ep


class _FunctionWorkflow:
    def __init__(self, fn: Callable[[EpisodeContext], Any]):
        self.fn = fn

    async def run_episode(self, ctx: EpisodeContext) -> Episode:
        return await self.fn(ctx)


BUILTIN_WORKFLOWS: dict[str, Callable[[], Workflow]] = {
    "single_turn": SingleTurn,
    "multi_turn": MultiTurn,
}


def load_workflow(spec: str) -> Workflow:
    """A built-in name, or an import path to a workflow object, class, or async function."""
    obj = load_object(spec, key="rollout.workflow", builtins=BUILTIN_WORKFLOWS)
    if spec in BUILTIN_WORKFLOWS or inspect.isclass(obj):
        obj = obj()
    elif inspect.iscoroutinefunction(obj):
        obj = _FunctionWorkflow(obj)
    if not inspect.iscoroutinefunction(getattr(obj, "run_episode", None)):
        raise PluginError(
            f"rollout.workflow: {spec!r} is not a workflow (an object with "
            "'async def run_episode(ctx)', or an async function of ctx)"
        )
    return obj
