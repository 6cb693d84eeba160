"""A minimal MCP server over stdio, standard library only: tools, nothing else.

Why not FastMCP (the ``mcp`` SDK's server): ``mcp:stdio:<command line>`` starts one server process
per episode (:mod:`asyncrl.agents.tool_envs`), and importing the SDK costs about a CPU-second, more
than an episode of a small model. This server speaks the same protocol (MCP's stdio transport:
JSON-RPC 2.0, one message per line) and starts in tens of milliseconds, so a demo on 2 cores can
run thousands of episodes through real MCP sessions (the ``mcp`` SDK is the client).

Served: ``initialize`` (the client's protocol version if known, else the newest here), ``ping``,
``tools/list``, ``tools/call``; notifications are read and ignored; any other method is answered
``-32601 method not found``. A tool that raises, or a call with missing or unknown arguments, is an
``isError`` result (the model sees the error text); an unknown tool is a ``-32602`` error. The
server ends when its stdin closes, as the MCP client's shutdown expects.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

PROTOCOL_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
"""MCP revisions whose tools methods this server answers as specified (newest last)."""

METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
PARSE_ERROR = -32700
INVALID_REQUEST = -32600


@dataclass(frozen=True, kw_only=True)
class ServedTool:
    """One tool: what ``tools/list`` shows and the function ``tools/call`` runs (keyword arguments,
    returns the result text)."""

    name: str
    description: str
    input_schema: dict[str, Any]
    fn: Callable[..., str]

    def listing(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "inputSchema": self.input_schema,
        }


class StdioServer:
    """Answers MCP requests read from ``stdin`` on ``stdout`` (one JSON message per line)."""

    def __init__(self, name: str, version: str, tools: list[ServedTool]) -> None:
        self.info = {"name": name, "version": version}
        self.tools = {t.name: t for t in tools}

    def serve(self, stdin: IO[str] | None = None, stdout: IO[str] | None = None) -> None:
        """Until ``stdin`` ends."""
        stdin = stdin or sys.stdin
        stdout = stdout or sys.stdout
        for line in stdin:
            if not line.strip():
                continue
            reply = self.handle_line(line)
            if reply is not None:
                stdout.write(json.dumps(reply, separators=(",", ":")) + "\n")
                stdout.flush()

    def handle_line(self, line: str) -> dict[str, Any] | None:
        """The reply to one message (None for a notification or a client's response)."""
        try:
            msg = json.loads(line)
        except json.JSONDecodeError as e:
            return _error(None, PARSE_ERROR, f"not JSON: {e}")
        if not isinstance(msg, dict) or msg.get("jsonrpc") != "2.0":
            return _error(None, INVALID_REQUEST, "not a JSON-RPC 2.0 message")
        if "method" not in msg:
            return None  # a response to a request of ours: this server sends none
        if "id" not in msg:
            return None  # a notification (notifications/initialized, cancelled, ...)
        rid, method = msg["id"], msg["method"]
        params = msg.get("params") or {}
        if not isinstance(params, dict):
            return _error(rid, INVALID_PARAMS, "params must be an object")
        if method == "initialize":
            asked = params.get("protocolVersion")
            version = asked if asked in PROTOCOL_VERSIONS else PROTOCOL_VERSIONS[-1]
            return _result(
                rid,
                {
                    "protocolVersion": version,
                    "capabilities": {"tools": {"listChanged": False}},
                    "serverInfo": self.info,
                },
            )
        if method == "ping":
            return _result(rid, {})
        if method == "tools/list":
            return _result(rid, {"tools": [t.listing() for t in self.tools.values()]})
        if method == "tools/call":
            return self._call(rid, params)
        return _error(rid, METHOD_NOT_FOUND, f"method {method!r} not found")

    def _call(self, rid: Any, params: dict[str, Any]) -> dict[str, Any]:
        tool = self.tools.get(params.get("name"))
        if tool is None:
            names = ", ".join(self.tools)
            return _error(rid, INVALID_PARAMS, f"no tool named {params.get('name')!r} ({names})")
        args = params.get("arguments") or {}
        if not isinstance(args, dict):
            return _error(rid, INVALID_PARAMS, "arguments must be an object")
        schema = tool.input_schema
        missing = [k for k in schema.get("required", []) if k not in args]
        unknown = [k for k in args if k not in schema.get("properties", {})]
        if missing or unknown:
            why = "; ".join(
                s
                for s in (
                    f"missing argument(s) {', '.join(missing)}" if missing else "",
                    f"unknown argument(s) {', '.join(unknown)}" if unknown else "",
                )
                if s
            )
            return _result(rid, _content(why, error=True))
        try:
            text = tool.fn(**args)
        except Exception as e:  # the tool's answer is an error the model sees
            return _result(rid, _content(f"{type(e).__name__}: {e}", error=True))
        return _result(rid, _content(str(text)))


def _content(text: str, *, error: bool = False) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "isError": error}


def _result(rid: Any, result: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "result": result}


def _error(rid: Any, code: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": message}}
