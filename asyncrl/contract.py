"""What a plug-in author writes against: read this file first (docs/agents.md, docs/design.md §6).

A recipe names user code by import path (``module:attr``, loaded by :mod:`asyncrl.plugins`):
``rollout.workflow`` a :class:`Workflow` (or a class of them, made with no arguments, or a bare
``async def episode(ctx: EpisodeContext) -> Episode``); ``rollout.reward`` a :data:`RewardFn`;
``rollout.tools`` functions (each a :class:`Tool`, from its signature and docstring), :class:`Tool`
objects or MCP servers. An :data:`Agent` on the OpenAI API is a workflow as
``asyncrl.agents.recording.AgentWorkflow(agent)``. These types import nothing above floor 2 (the
wire format, Qwen's tool calls), so every room uses them; the machinery they name (the generators,
the tools) is typed by what a workflow may call on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import trio

from asyncrl.moe import splice_routes
from asyncrl.tool_calls import ToolCall  # the model's call: name and arguments
from asyncrl.wire import FINISH_REASONS

RewardFn = Callable[..., Any]
"""Called as ``fn(prompt, completion, prompt_ids, completion_ids, **row)``: the prompt and the
completion as text, their token ids, every field of the dataset row (plus ``answer``, from the
recipe's ``data.answer_key``, and the sample's ``finish_reason``). Returns a finite number (``bool``
counts as 0/1); may be ``async``. One that raises, times out or returns no number fails its sample,
which then leaves its group: never a crash, never a 0 trained on (:mod:`asyncrl.rewards`)."""

Agent = Callable[[Any, dict[str, Any]], Awaitable[float | None]]
"""``async def agent(client, row)``: talks to ``client`` as to ``openai.AsyncOpenAI`` (a
:class:`asyncrl.agents.recording.RecordingClient`) and returns its reward, or None for the recipe's
reward function to score the trajectory."""


@dataclass(kw_only=True)
class Completion:
    """What one :meth:`EpisodeContext.generate` call produced, possibly over several requests."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # stop | length | abort (abort only when resuming gave up)
    matched_stop: int | str | None = None
    num_resumes: int = 0  # requests re-sent after an abort
    num_retractions: int = 0
    generator: str = ""  # URL of the generator that produced the last tokens
    # with routing replay (docs/moe.md): the experts of every position of the input and the
    # output but its last token, [positions, moe layers, top_k] (asyncrl.moe.splice_routes)
    routed_experts: np.ndarray | None = None


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
    # with routing replay: the experts of every position fed so far (Completion.routed_experts)
    routed_experts: np.ndarray | None = None

    def add_generated(self, c: Completion) -> None:
        self.completion_ids += c.output_ids
        self.logprobs += c.logprobs
        self.versions += c.versions
        self.loss_mask += [1] * len(c.output_ids)
        if c.routed_experts is not None:  # each turn's own routes for the tokens it sampled
            self.routed_experts = splice_routes(
                self.routed_experts, c.routed_experts, len(c.output_ids)
            )

    def add_external(self, ids: list[int]) -> None:
        """Tokens the policy did not produce (tool output): masked out of the loss."""
        v = self.versions[-1] if self.versions else 0
        self.completion_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [v] * len(ids)
        self.loss_mask += [0] * len(ids)

    @property
    def made_tool_call(self) -> bool:
        """Whether the episode made at least one valid tool call: one the tool answered without an
        error (``metadata["tool_calls"]``, as ``MultiTurn`` records them). The tool-call rate
        counts these episodes."""
        calls = self.metadata.get("tool_calls") or []
        return any(isinstance(c, dict) and c.get("ok") for c in calls)

    def check(self) -> None:
        n = len(self.completion_ids)
        for name in ("logprobs", "versions", "loss_mask"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"episode.{name} has {len(getattr(self, name))} entries, not {n}")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"episode.finish_reason {self.finish_reason!r}")


@dataclass(kw_only=True)
class Tool:
    """A function the model may call: its name, description and arguments' JSON schema are what a
    chat template shows the model."""

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    fn: Callable[..., Any]

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema chat templates take (``tools=[...]``)."""
        function = {"name": self.name, "description": self.description}
        return {"type": "function", "function": {**function, "parameters": self.parameters}}


@dataclass(kw_only=True)
class ToolResult:
    """What one tool call gave: the text the model sees (``error: ...`` on failure) and why."""

    text: str
    ok: bool = True
    error: str = ""
    timed_out: bool = False
    seconds: float = 0.0

    @classmethod
    def failed(cls, error: str, *, timed_out: bool = False) -> ToolResult:
        return cls(text=f"error: {error}", ok=False, error=error, timed_out=timed_out)

    def record(self, name: str, turn: int) -> dict[str, Any]:
        """The entry of an episode's ``metadata["tool_calls"]``."""
        keys = {"turn": turn, "name": name, "ok": self.ok, "error": self.error}
        return {**keys, "timed_out": self.timed_out, "seconds": round(self.seconds, 4)}


class ToolingEnv(Protocol):
    """One episode's tools (a sandbox, a browser session are the episode's own): ``initialise`` ->
    ``list_tools`` / ``execute`` ... -> ``close``. A failed call is an ``error: ...`` result."""

    async def initialise(self) -> None: ...

    def list_tools(self) -> list[dict[str, Any]]: ...  # function schemas, as templates take them

    async def execute(self, call: ToolCall) -> ToolResult: ...

    async def close(self) -> None: ...


class Tools(Protocol):
    """The recipe's tools (:class:`asyncrl.agents.tools.ToolRegistry`, ``ToolSet``)."""

    timeout_s: float

    def open(self) -> ToolingEnv: ...


class Generators(Protocol):
    """The policy's generators (:class:`asyncrl.rollout.generator_pool.GeneratorPool`)."""

    async def generate(self, input_ids: list[int], params: Any, **kw: Any) -> Completion: ...


@dataclass(kw_only=True)
class EpisodeContext:
    """Everything a workflow may use for one episode."""

    prompt_ids: list[int]
    prompt_text: str
    row: dict[str, Any]  # the dataset row
    pool: Generators
    params: Any  # the recipe's sampling: asyncrl.rollout.sglang_protocol.SamplingParams
    tokenizer: Any
    tools: Tools  # the recipe's Python tools (a ToolRegistry)
    max_turns: int
    rid: str  # prefix of this episode's SGLang request ids (its group's id comes first)
    requests: int = 0  # generate calls so far
    batcher: Any = None  # shared by the group's episodes: same-tick calls go as one
    tool_set: Tools | None = None  # the recipe's tools (MCP servers too); else ``tools``
    chat_template: bool = False  # the prompt was rendered with the tokenizer's chat template

    def open_tools(self) -> ToolingEnv:
        """A new :class:`ToolingEnv` for this episode (initialise it, close it after)."""
        return self.tool_set.open() if self.tool_set else self.tools.open()

    async def generate(
        self, input_ids: list[int], *, max_new_tokens: int | None = None, **overrides: Any
    ) -> Completion:
        """One completion from the generators with the recipe's sampling (``overrides`` replace
        fields of ``SamplingParams``, e.g. ``stop=[...]``)."""
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
    """How one episode (one sample of a group) is generated: the workflow owns the loop."""

    async def run_episode(self, ctx: EpisodeContext) -> Episode: ...
