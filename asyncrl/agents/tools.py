"""Tools for multi-turn workflows: local Python functions with JSON schemas from their signatures.

In the spirit of AReaL's ``ToolingEnv``: a tool is a plain (sync or async) function; its name, its
description (the docstring's first paragraph) and its parameters' JSON schema (from the type hints)
are what a chat template shows the model. A tool call the model gets wrong (unknown tool, missing
argument) or a tool that raises or times out is answered with an ``error: ...`` text the model sees,
and counted; it never ends the episode with an exception.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from typing import Any

import trio

from asyncrl.contract import Tool, ToolingEnv, ToolResult  # here too: plugins import them from here
from asyncrl.plugins import PluginError, load_object
from asyncrl.tool_calls import (  # here too: plugins and tests import them from agents.tools
    QWEN_CALL_CLOSE,
    QWEN_CALL_OPEN,
    QwenToolCallStream,
    ToolCall,
    parse_qwen_tool_calls,
)

__all__ = [
    "QWEN_CALL_CLOSE",
    "QWEN_CALL_OPEN",
    "QwenToolCallStream",
    "Tool",
    "ToolCall",
    "ToolRegistry",
    "ToolResult",
    "load_tools",
    "parse_qwen_tool_calls",
    "parse_tagged_tool_call",
    "tool_from_function",
]

_JSON_TYPES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    tuple: "array",
    dict: "object",
}


def _json_type(tp: Any) -> dict[str, Any]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [t for t in typing.get_args(tp) if t is not type(None)]
        return _json_type(options[0]) if len(options) == 1 else {}
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(tp))}
    if origin in (list, tuple):
        args = typing.get_args(tp)
        item = _json_type(args[0]) if args else {}
        return {"type": "array", **({"items": item} if item else {})}
    if origin is dict:
        return {"type": "object"}
    t = _JSON_TYPES.get(tp)
    return {"type": t} if t else {}


def tool_from_function(fn: Callable[..., Any], *, name: str | None = None) -> Tool:
    """A :class:`Tool` from a function's signature, type hints and docstring."""
    sig = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable annotations: describe the parameters without types
        hints = {}
    props: dict[str, Any] = {}
    required: list[str] = []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        props[p.name] = _json_type(hints.get(p.name, Any))
        if p.default is p.empty:
            required.append(p.name)
    doc = inspect.getdoc(fn) or ""
    return Tool(
        name=name or fn.__name__,
        description=doc.split("\n\n")[0].replace("\n", " "),
        parameters={"type": "object", "properties": props, "required": required},
        fn=fn,
    )


def load_tools(specs: list[str]) -> list[Tool]:
    """``rollout.tools``: import paths of functions (or of ready :class:`Tool` objects)."""
    out = []
    for i, spec in enumerate(specs):
        obj = load_object(spec, key=f"rollout.tools[{i}]")
        if isinstance(obj, Tool):
            out.append(obj)
        elif callable(obj):
            out.append(tool_from_function(obj))
        else:
            raise PluginError(f"rollout.tools[{i}]: {spec!r} is not a function")
    return out


_TAGGED = re.compile(r"<tool>(.*?)</tool>", re.DOTALL)


def parse_tagged_tool_call(text: str) -> ToolCall | None:
    """The first ``<tool>{"name": ..., "arguments": {...}}</tool>`` in ``text``, else None.

    A tag whose body is not that JSON is still a call (to the tool named ``""``), so the model is
    told its call was malformed instead of being silently ignored.
    """
    m = _TAGGED.search(text)
    if not m:
        return None
    try:
        body = json.loads(m.group(1))
    except json.JSONDecodeError:
        return ToolCall(name="", arguments={"_error": "the tool call is not valid JSON"})
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return ToolCall(name="", arguments={"_error": 'expected {"name": ..., "arguments": {...}}'})
    args = body.get("arguments", {})
    if not isinstance(args, dict):
        return ToolCall(name=body["name"], arguments={"_error": "arguments must be an object"})
    return ToolCall(name=body["name"], arguments=args)


class ToolRegistry:
    """Runs tool calls by name: sync tools in a thread, all with a timeout; never raises."""

    def __init__(self, tools: list[Tool], *, timeout_s: float = 30.0, max_threads: int = 8):
        self.tools = {t.name: t for t in tools}
        self.timeout_s = timeout_s
        self.limiter = trio.CapacityLimiter(max_threads)
        self.stats = {"calls": 0, "errors": 0, "timeouts": 0}

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools.values()]

    def open(self) -> ToolingEnv:
        """An episode's :class:`LocalToolingEnv` of these tools."""
        return LocalToolingEnv(self)

    async def call(self, call: ToolCall) -> tuple[str, bool]:
        """(result text, ok). Errors come back as ``error: ...`` text with ok False."""
        r = await self.execute(call)
        return r.text, r.ok

    async def execute(self, call: ToolCall) -> ToolResult:
        """The call's :class:`ToolResult`; never raises."""
        self.stats["calls"] += 1
        t0 = trio.current_time()
        r = await self._call(call)
        r.seconds = trio.current_time() - t0
        if not r.ok:
            self.stats["errors"] += 1
        if r.timed_out:
            self.stats["timeouts"] += 1
        return r

    async def _call(self, call: ToolCall) -> ToolResult:
        if "_error" in call.arguments:
            return ToolResult.failed(call.arguments["_error"])
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult.failed(
                f"no tool named {call.name!r} (tools: {', '.join(self.tools)})"
            )
        props = tool.parameters["properties"]
        missing = [k for k in tool.parameters["required"] if k not in call.arguments]
        if missing:
            return ToolResult.failed(f"{call.name} needs argument(s) {', '.join(missing)}")
        unknown = [k for k in call.arguments if k not in props]
        if unknown and not _takes_kwargs(tool.fn):
            return ToolResult.failed(f"{call.name} has no argument(s) {', '.join(unknown)}")
        fn = functools.partial(tool.fn, **call.arguments)
        result: Any = None
        try:
            with trio.move_on_after(self.timeout_s) as scope:
                if inspect.iscoroutinefunction(tool.fn):
                    result = await fn()
                else:
                    result = await trio.to_thread.run_sync(
                        fn, abandon_on_cancel=True, limiter=self.limiter
                    )
        except Exception as e:  # the tool's own bug: reported to the model, counted
            return ToolResult.failed(f"{call.name} raised {type(e).__name__}: {e}")
        if scope.cancelled_caught:
            return ToolResult.failed(
                f"{call.name} timed out after {self.timeout_s:g}s", timed_out=True
            )
        if isinstance(result, str):
            return ToolResult(text=result)
        try:
            return ToolResult(text=json.dumps(result))
        except (TypeError, ValueError):
            return ToolResult(text=str(result))


def _takes_kwargs(fn: Callable[..., Any]) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())


class LocalToolingEnv:
    """Python tools: stateless functions, so one registry serves every episode."""

    def __init__(self, registry: ToolRegistry) -> None:
        self.registry = registry

    async def initialise(self) -> None:
        pass

    def list_tools(self) -> list[dict[str, Any]]:
        return self.registry.schemas()

    async def execute(self, call: ToolCall) -> ToolResult:
        return await self.registry.execute(call)

    async def close(self) -> None:
        pass
