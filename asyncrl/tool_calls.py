"""A model's tool calls as text: :class:`ToolCall`, and Qwen's ``<tool_call>`` format parsed whole
and as a stream. Shared by the built-in engine's ``/v1/chat/completions`` (asyncrl/engine/openai.py)
and the rollout side (asyncrl/rollout/: workflows, the recording client); asyncrl.agents.tools
re-exports these names for code written against it."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass(kw_only=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


# ---- Qwen's tool-call format (Qwen2.5 and Qwen3 chat templates) ----------------------------------
# The model writes each call as ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``. The
# rules below are SGLang 0.5.23's ``qwen25`` parser's (python/sglang/srt/function_call/
# qwen25_detector.py): the content is the text before the first call, stripped; a block whose body
# is not JSON, or that names a tool the request did not declare, is dropped; text after the first
# call is not content.

QWEN_CALL_OPEN = "<tool_call>\n"
QWEN_CALL_CLOSE = "\n</tool_call>"
_QWEN_BLOCK = re.compile(
    re.escape(QWEN_CALL_OPEN) + r"(.*?)" + re.escape(QWEN_CALL_CLOSE), re.DOTALL
)


def _qwen_call(body: str, names: set[str]) -> ToolCall | None:
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(name=obj["name"], arguments=args if isinstance(args, dict) else {})


def parse_qwen_tool_calls(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a finished completion in Qwen's format; ``names`` are the declared tools.

    Without a ``<tool_call>`` the whole text is content, untouched.
    """
    at = text.find(QWEN_CALL_OPEN)
    if at < 0:
        return text, []
    calls = [c for b in _QWEN_BLOCK.findall(text) if (c := _qwen_call(b, names)) is not None]
    return text[:at].strip(), calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest proper prefix of ``marker`` that ``text`` ends with."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


@dataclass
class QwenToolCallStream:
    """:func:`parse_qwen_tool_calls` for a completion that grows: feed it the whole text so far,
    get back the content not yet sent and the calls completed since the last feed.

    Content that might be the start of ``<tool_call>``, and trailing whitespace (stripped if a call
    follows), is held back until the text decides it; after the first call everything is calls.
    The content sent adds up to the parsed content, except leading whitespace before a call."""

    names: set[str]
    sent: int = 0  # characters of the text sent as content
    calls_seen: int = 0  # complete blocks seen (parsed or dropped)
    in_calls: bool = False

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        if not self.in_calls:
            at = text.find(QWEN_CALL_OPEN, self.sent)
            if at >= 0:
                self.in_calls = True
                out = text[self.sent : at].rstrip()
                self.sent = at
                return out, self._feed_calls(text)[1]
            if final:
                out, self.sent = text[self.sent :], len(text)
                return out, []
            end = len(text) - _partial_suffix(text, QWEN_CALL_OPEN)
            end = self.sent + len(text[self.sent : end].rstrip())
            out, self.sent = text[self.sent : end], max(self.sent, end)
            return out, []
        return self._feed_calls(text)

    def _feed_calls(self, text: str) -> tuple[str, list[ToolCall]]:
        blocks = _QWEN_BLOCK.findall(text, self.sent)
        new = blocks[self.calls_seen :]
        self.calls_seen = len(blocks)
        return "", [c for b in new if (c := _qwen_call(b, self.names)) is not None]
