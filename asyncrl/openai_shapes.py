"""Pieces of OpenAI-shaped chat responses shared by the built-in engine's ``/v1/chat/completions``
and the rollout side's recording client, so both answer in the same shape (SGLang 0.5.23's)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from asyncrl.tool_calls import ToolCall


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
        "reasoning_tokens": 0,
        "completion_tokens_details": None,
    }


def tool_call_json(call: ToolCall, index: int) -> dict:
    """One OpenAI ``tool_calls`` entry: arguments as a JSON string, ids as SGLang makes them."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "index": index,
        "type": "function",
        "function": {
            "name": call.name,
            "arguments": json.dumps(call.arguments, ensure_ascii=False),
        },
    }


def finish(fin: dict | None, with_calls: bool) -> tuple[str | None, Any]:
    """(finish_reason, matched_stop): a natural stop after a tool call is ``tool_calls``."""
    if not fin:
        return None, None
    if with_calls and fin["type"] == "stop":
        return "tool_calls", None
    return fin["type"], fin.get("matched")
