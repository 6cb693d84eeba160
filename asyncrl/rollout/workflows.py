"""Workflows: how one episode (one sample of a group) is generated (docs/design.md §6).

A workflow owns the loop, as AReaL's ``RolloutWorkflow.arun_episode`` does: it gets an
:class:`EpisodeContext` (the prompt, the generators, the tokenizer, the tools) and returns an
:class:`Episode` (the completion's tokens with one logprob, version and loss-mask entry each). Those
types, and :class:`Workflow`, are :mod:`asyncrl.contract`'s (the file a plug-in author reads first).

- :class:`SingleTurn`: one generation.
- :class:`MultiTurn`: generate, parse a tool call, run the tool, append its result with loss_mask 0
  (logprob 0: the policy did not produce it), repeat up to ``max_turns``; one token budget
  (``max_new_tokens``) covers the whole completion, tool results included. The tools run in the
  episode's own :class:`ToolingEnv` (Python functions or MCP servers). With the recipe's chat
  template the result goes through the template's ``tool`` role, and Qwen's ``<tool_call>`` blocks
  are parsed when the template is Qwen's.
- Users plug in their own by import path (``rollout.workflow: my_module:my_workflow``): an object
  with ``async run_episode(ctx) -> Episode`` (e.g. a configured ``MultiTurn``), a class of such
  objects (made with no arguments), or a bare ``async def episode(ctx) -> Episode``.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import trio

from asyncrl.agents.tool_envs import ToolSet, opened
from asyncrl.agents.tools import (
    QWEN_CALL_OPEN,
    ToolRegistry,
    parse_qwen_tool_calls,
    parse_tagged_tool_call,
)
from asyncrl.contract import (  # Episode, EpisodeContext, Workflow here too: plugins import them
    Episode,
    EpisodeContext,
    Tool,
    ToolCall,
    ToolingEnv,
    Workflow,
)
from asyncrl.plugins import PluginError, load_object

log = logging.getLogger("asyncrl.rollout.worker")


def gives_tools(workflow: Workflow, tools: ToolRegistry, tool_set: ToolSet | None) -> bool:
    """Whether episodes have tools to call: the recipe's (Python functions or MCP servers) or the
    workflow's own. A tool-call rate is measured only then."""
    if tool_set is not None and tool_set.servers:
        return True
    return bool(tools.tools) or bool(getattr(workflow, "tools", None))


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


_TURN_END = "\u2063asyncrl-assistant-turn\u2063"  # marks where the assistant's text ends


def chat_tool_turn(tokenizer: Any, result: str, last_token: int | None) -> str:
    """The text the chat template puts between an assistant turn's text and the next assistant
    turn's first token, for one ``tool`` message holding ``result``: the end of the assistant turn
    (less the end token the model generated itself, ``last_token``), the tool turn, and the
    generation prompt. Blocking: call it from a thread."""
    messages = [
        {"role": "user", "content": "."},
        {"role": "assistant", "content": _TURN_END},
        {"role": "tool", "content": result},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    tail = text[text.rindex(_TURN_END) + len(_TURN_END) :]
    if result.strip() and result.strip() not in tail:
        raise ValueError("the template does not show tool messages")
    if last_token is not None and last_token in set(tokenizer.all_special_ids):
        end = tokenizer.convert_ids_to_tokens(last_token)
        if tail.startswith(end):
            tail = tail[len(end) :]
    return tail


def _is_qwen_template(tokenizer: Any) -> bool:
    return QWEN_CALL_OPEN.strip() in str(getattr(tokenizer, "chat_template", "") or "")


class MultiTurn:
    """Generate → parse a tool call → run it → append its result (loss_mask 0) → repeat.

    ``parse_tool_call(text of this turn) -> ToolCall | None`` (default: ``<tool>{json}</tool>``, or
    Qwen's ``<tool_call>`` under a Qwen chat template); ``format_result(call, result) -> text``
    (default: ``\\n<result>...</result>\\n``; under the recipe's chat template, the template's
    ``tool`` role, :func:`chat_tool_turn`). Each turn stops at ``stop`` (default ``</tool>``; none
    under a chat template: the turn ends with the template's end token) or after
    ``turn_max_new_tokens``; the episode ends when a turn has no tool call, the budget is spent, or
    after ``max_turns`` turns. ``metadata["tool_calls"]``: one ``{turn, name, ok, error, timed_out,
    seconds}`` per call.
    """

    def __init__(
        self,
        *,
        tools: list[Tool | Callable[..., Any]] | None = None,
        parse_tool_call: Callable[[str], ToolCall | None] | None = None,
        format_result: Callable[[ToolCall, str], str] | None = None,
        stop: tuple[str, ...] | None = None,
        max_turns: int | None = None,
        turn_max_new_tokens: int | None = None,
    ) -> None:
        from asyncrl.agents.tools import tool_from_function

        self.tools = (
            None
            if tools is None
            else [t if isinstance(t, Tool) else tool_from_function(t) for t in tools]
        )
        self.parse_tool_call = parse_tool_call
        self.format_result = format_result
        self.stop = None if stop is None else list(stop)
        self.max_turns = max_turns
        self.turn_max_new_tokens = turn_max_new_tokens
        self._warned = False

    def _env(self, ctx: EpisodeContext) -> ToolingEnv:
        if self.tools:
            return ToolRegistry(self.tools, timeout_s=ctx.tools.timeout_s).open()
        return ctx.open_tools()

    async def run_episode(self, ctx: EpisodeContext) -> Episode:
        async with opened(self._env(ctx)) as env:
            return await self._run(ctx, env)

    async def _run(self, ctx: EpisodeContext, env: ToolingEnv) -> Episode:
        chat = ctx.chat_template and self.format_result is None
        parse = self.parse_tool_call
        if parse is None:
            if chat and _is_qwen_template(ctx.tokenizer):
                names = {s["function"]["name"] for s in env.list_tools()}
                parse = _first_qwen_call(names)
            else:
                parse = parse_tagged_tool_call
        own_stop = self.stop if self.stop is not None else ([] if chat else ["</tool>"])
        budget = ctx.params.max_new_tokens
        max_turns = self.max_turns or ctx.max_turns
        stop = list(dict.fromkeys(ctx.params.stop + own_stop))
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
            call = parse(await ctx.decode(c.output_ids))
            if call is None:
                break
            result = await env.execute(call)
            calls.append(result.record(call.name, turn))
            if chat:
                last = c.output_ids[-1] if c.output_ids else None
                try:
                    text = await trio.to_thread.run_sync(
                        chat_tool_turn, ctx.tokenizer, result.text, last
                    )
                except Exception as e:  # a template without a tool role: say so, go on
                    if not self._warned:
                        self._warned = True
                        log.warning(
                            "the chat template cannot render a tool result (%s): "
                            "tool results are plain text",
                            e,
                        )
                    chat = False
                    text = tagged_result(call, result.text)
            else:
                text = (self.format_result or tagged_result)(call, result.text)
            ids = await ctx.encode(text)
            room = budget - len(ep.completion_ids)
            if len(ids) >= room:  # the result does not leave room for another turn
                ep.add_external(ids[:room])
                ep.finish_reason = "length"
                break
            ep.add_external(ids)
        ep.metadata["tool_calls"] = calls
        ep.metadata["turns"] = ctx.requests
        return ep


def _first_qwen_call(names: set[str]) -> Callable[[str], ToolCall | None]:
    def parse(text: str) -> ToolCall | None:
        _, calls = parse_qwen_tool_calls(text, names)
        return calls[0] if calls else None

    return parse


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
