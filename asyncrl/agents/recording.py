"""A recording OpenAI client: an agent written for ``openai.AsyncOpenAI`` runs as a workflow
(docs/design.md §6, "Agents on the OpenAI API").

``RecordingClient(ctx).chat.completions.create(messages=..., tools=...)`` renders the chat with the
tokenizer's own chat template, generates through ``ctx.generate`` (``/generate``: exact token ids,
logprobs and weight versions, the recipe's sampling) and answers with the ``openai`` package's
``ChatCompletion`` (content and Qwen ``<tool_call>`` calls parsed as the built-in engine does). Every
call is recorded into one :class:`Trajectory`, which becomes one :class:`Episode`: the first call's
prompt is the sample's prompt; everything after it is the completion, with loss_mask 1 exactly on the
tokens the model produced and 0 on the template, tool and user tokens between turns.

The token-consistency rule: a conversation is one token sequence. Each call's rendered prompt
*text* must extend the text so far (the previous prompt + the previous completion decoded with its
special tokens); its ids are then the ids so far + the encoded new text, so the model's own tokens are
never re-tokenised. One exception: a turn that ended on a stop token the template does not write where
the model did (an EOS that is not the template's turn end) extends it once that token is left out; it
is then dropped from the trajectory (the next call never saw it), counted in
``metadata["dropped_stop_tokens"]``. An EOS that is the template's turn end (Qwen's ``<|im_end|>``)
stays and is trained. A call whose rendering extends the conversation neither way (the agent edited
or dropped earlier turns; a template that re-renders them, as Qwen3 strips earlier ``<think>`` blocks
once a new user turn comes, or adds an empty think block to the generation prompt only under
``enable_thinking=False``; tool arguments re-serialised differently from how the model wrote them)
raises :class:`TrajectoryMismatch`, naming where the texts part, before anything is recorded: the
agent may go on from the conversation as it was, and nothing is trained on tokens the model never saw.

Sampling stays the recipe's (temperature, top-p/k: the learner's ratios assume it); an agent's
``stop`` and ``max_tokens`` apply. ``max_new_tokens`` bounds the whole completion, tokens between
turns included (as :class:`~asyncrl.rollout.workflows.MultiTurn`); a call with no room left answers
``finish_reason="length"`` without generating.
"""

from __future__ import annotations

import inspect
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from asyncrl.contract import Agent, Completion, Episode, EpisodeContext
from asyncrl.openai_shapes import finish, tool_call_json, usage
from asyncrl.tool_calls import parse_qwen_tool_calls


class TrajectoryMismatch(ValueError):
    """A call's rendered prompt does not extend the conversation's token sequence so far."""


@dataclass
class Call:
    """One recorded ``create`` call: what the engine saw and produced."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str


@dataclass
class Trajectory:
    """The calls of one conversation as one token sequence (pure: no I/O, no tokenizer).

    ``text`` is the rendering of ``prompt_ids + completion_ids``, the reference the next call's
    rendered prompt must extend."""

    prompt_ids: list[int] = field(default_factory=list)
    episode: Episode = field(default_factory=Episode)
    text: str = ""
    calls: list[Call] = field(default_factory=list)
    # ``text`` without the last call's final stop token, if it ended on one (module docstring)
    text_without_stop: str | None = None

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.episode.completion_ids

    def next_prompt(self, text: str, encode: Callable[[str], list[int]]) -> list[int]:
        """The ids of the next call's prompt, rendered as ``text``; the tokens new in it (template,
        tool results, user turns) join the completion with loss_mask 0."""
        if not self.calls:
            self.prompt_ids, self.text = encode(text), text
            if not self.prompt_ids:
                raise ValueError("the chat template rendered the messages to an empty prompt")
            return list(self.prompt_ids)
        alt = self.text_without_stop
        drop = not text.startswith(self.text) and alt is not None and text.startswith(alt)
        ref = alt if drop else self.text
        if not text.startswith(ref):  # raised before any change: the agent may go on
            at = next(
                (i for i, (a, b) in enumerate(zip(text, ref, strict=False)) if a != b),
                min(len(text), len(ref)),
            )
            lo = max(0, at - 40)
            raise TrajectoryMismatch(
                f"call {len(self.calls) + 1}'s rendered prompt does not extend the conversation "
                f"so far: they part at character {at}: {ref[lo : at + 40]!r} became "
                f"{text[lo : at + 40]!r} (earlier turns must be passed back unchanged, and "
                "the chat template must render them as the model saw them)"
            )
        ep = self.episode
        if drop:
            for name in ("completion_ids", "logprobs", "versions", "loss_mask"):
                getattr(ep, name).pop()
            ep.metadata["dropped_stop_tokens"] = ep.metadata.get("dropped_stop_tokens", 0) + 1
        self.text_without_stop = None
        if len(text) > len(ref):
            ep.add_external(encode(text[len(ref) :]))
        self.text = text
        return self.ids

    def add(
        self, prompt_ids: list[int], c: Completion, text: str, without_stop: str | None = None
    ) -> None:
        """Record a call's completion; ``text`` is its decoding with special tokens, and if it
        ended on a stop token, ``without_stop`` its decoding without that token."""
        self.calls.append(
            Call(
                prompt_ids, list(c.output_ids), list(c.logprobs), list(c.versions), c.finish_reason
            )
        )
        self.episode.add_generated(c)
        self.episode.finish_reason = c.finish_reason
        self.text_without_stop = None if without_stop is None else self.text + without_stop
        self.text += text

    def to_episode(self, reward: float | None = None, budget: int = 0) -> Episode:
        """The trajectory as one episode; ``reward`` replaces the recipe's reward function. Tokens
        past ``budget`` (0: none) are cut, as MultiTurn cuts a tool result: only text between turns
        can lie there, since each call generates within what is left."""
        if not self.calls:
            raise ValueError("the agent made no chat.completions.create call")
        ep = self.episode
        if budget and len(ep.completion_ids) > budget:
            for name in ("completion_ids", "logprobs", "versions", "loss_mask"):
                del getattr(ep, name)[budget:]
            ep.finish_reason = "length"
        ep.prompt_ids = list(self.prompt_ids)
        ep.reward = reward
        ep.metadata["turns"] = len(self.calls)
        ep.metadata["resumes"] = ep.metadata.get("resumes", 0)
        return ep


# Fields an agent may pass that the recording client accepts and ignores. Temperature and nucleus
# settings are the recipe's: the learner's importance ratios assume the recipe's sampling.
_IGNORED = frozenset(
    {
        "temperature",
        "top_p",
        "logprobs",
        "top_logprobs",
        "user",
        "metadata",
        "parallel_tool_calls",
        "store",
        "extra_headers",
        "extra_query",
        "timeout",
        "seed",
    }
)


class RecordingClient:
    """Looks like ``openai.AsyncOpenAI`` for ``chat.completions.create``; records every call into
    ``self.trajectory`` (module docstring). Concurrent calls are serialised: one conversation."""

    def __init__(self, ctx: EpisodeContext, *, template_kwargs: dict[str, Any] | None = None):
        self.ctx = ctx
        self.template_kwargs = dict(template_kwargs or {})
        self.trajectory = Trajectory()
        self.chat = _Chat(self)
        self._lock = trio.Lock()  # calls of one conversation follow each other

    def _render(self, messages: list[dict], tools: list[dict] | None) -> str:
        return self.ctx.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=True,
            tokenize=False,
            **self.template_kwargs,
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.ctx.tokenizer.encode(text, add_special_tokens=False))

    async def create(self, **kwargs: Any) -> Any:
        """``chat.completions.create``: one recorded call (module docstring)."""
        async with self._lock:
            return await self._create(**kwargs)

    async def _create(
        self,
        *,
        messages: list[Any],
        model: str | None = None,
        tools: list[dict] | None = None,
        tool_choice: str | None = None,
        max_tokens: int | None = None,
        max_completion_tokens: int | None = None,
        stop: str | list[str] | None = None,
        n: int = 1,
        stream: bool = False,
        **kwargs: Any,
    ) -> Any:
        from openai.types.chat import ChatCompletion

        unknown = sorted(set(kwargs) - _IGNORED)
        if unknown:
            raise TypeError(f"the recording client does not support {unknown}")
        if n != 1 or stream:
            raise ValueError("the recording client makes one non-streamed choice (n=1)")
        if tool_choice not in (None, "auto", "none"):
            raise ValueError(f"tool_choice {tool_choice!r}: only 'auto' or 'none'")
        shown = None if tool_choice == "none" else tools
        msgs = [_plain(m) for m in messages]
        tok_text = await trio.to_thread.run_sync(self._render, msgs, shown)
        prompt = await trio.to_thread.run_sync(self.trajectory.next_prompt, tok_text, self._encode)
        ep = self.trajectory.episode
        room = self.ctx.params.max_new_tokens - len(ep.completion_ids)
        limit = max_completion_tokens or max_tokens or room
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if min(limit, room) <= 0:  # the episode's token budget is spent: no generation
            c = Completion(output_ids=[], logprobs=[], versions=[], finish_reason="length")
        else:
            c = await self.ctx.generate(
                prompt,
                max_new_tokens=min(limit, room),
                stop=list(dict.fromkeys(self.ctx.params.stop + stops)),
            )
        tok = self.ctx.tokenizer
        out = c.output_ids
        ends_on_token = bool(out) and c.finish_reason == "stop" and c.matched_stop == out[-1]

        def decode() -> tuple[str, str, str | None]:
            return (
                tok.decode(out, skip_special_tokens=False),
                tok.decode(out, skip_special_tokens=True),
                tok.decode(out[:-1], skip_special_tokens=False) if ends_on_token else None,
            )

        full, text, without_stop = await trio.to_thread.run_sync(decode)
        self.trajectory.add(prompt, c, full, without_stop)
        ep.metadata["resumes"] = ep.metadata.get("resumes", 0) + c.num_resumes
        return ChatCompletion.model_validate(
            _response(c, text, prompt, shown, model or "asyncrl", self.ctx.rid)
        )

    def episode(self, reward: float | None = None) -> Episode:
        """The recorded conversation as one episode (``reward``: None leaves it to the recipe)."""
        return self.trajectory.to_episode(reward, self.ctx.params.max_new_tokens)


class _Completions:
    def __init__(self, client: RecordingClient):
        self.create = client.create


class _Chat:
    def __init__(self, client: RecordingClient):
        self.completions = _Completions(client)


def _plain(m: Any) -> dict:
    """A message as a dict (the agent may pass back the response's pydantic message)."""
    if isinstance(m, dict):
        return m
    d = m.model_dump(exclude_none=True)
    for call in d.get("tool_calls") or []:
        call.pop("index", None)
    return d


def _response(
    c: Completion, text: str, prompt: list[int], tools: list[dict] | None, model: str, rid: str
) -> dict:
    """The ``ChatCompletion`` body, as the built-in engine's ``/v1/chat/completions`` makes it."""
    content, calls = text, []
    if tools:
        content, calls = parse_qwen_tool_calls(text, {t["function"]["name"] for t in tools})
    fin = {"type": c.finish_reason, "matched": c.matched_stop}
    reason, matched = finish(fin, bool(calls))
    if reason == "abort":  # OpenAI's finish reasons have no abort; the episode records it
        reason = "length"
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [tool_call_json(call, k) for k, call in enumerate(calls)]
    return {
        "id": f"{rid}-{uuid.uuid4().hex[:8]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": reason,
                "matched_stop": matched,
                "prompt_token_ids": prompt,
                "response_token_ids": c.output_ids,
                # what was recorded, per completion token (OpenAI's metadata holds only strings)
                "response_logprobs": c.logprobs,
                "response_weight_versions": c.versions,
            }
        ],
        "usage": usage(len(prompt), len(c.output_ids)),
    }


class AgentWorkflow:
    """An agent on the OpenAI API as a workflow: ``async def agent(client, row)`` talks to
    ``client`` (a :class:`RecordingClient`) and returns its reward (a number) or None (the recipe's
    reward function then scores the trajectory). Name it in a recipe as any workflow object:
    ``my_module:workflow`` with ``workflow = AgentWorkflow(agent)``."""

    def __init__(self, agent: Agent, *, template_kwargs: dict[str, Any] | None = None):
        if not inspect.iscoroutinefunction(agent):
            raise TypeError("the agent must be an async function of (client, row)")
        self.agent = agent
        self.template_kwargs = template_kwargs

    async def run_episode(self, ctx: EpisodeContext) -> Episode:
        client = RecordingClient(ctx, template_kwargs=self.template_kwargs)
        return client.episode(checked_reward(await self.agent(client, ctx.row)))


def checked_reward(out: Any) -> float | None:
    """An agent's return value as the episode's reward: a finite number, or None."""
    if out is None:
        return None
    if not isinstance(out, int | float):  # bool counts as 0/1, as a reward function's
        raise TypeError(f"the agent returned {type(out).__name__}, not a reward or None")
    if not math.isfinite(out):
        raise ValueError(f"the agent's reward is {out}")
    return float(out)
