"""A tiny MCP server for the tool-environment tests (FastMCP from the ``mcp`` SDK).

``python tests/mcp_server.py stdio`` serves over stdio; ``... http PORT`` over streamable HTTP on
loopback. ``--add hang`` makes ``add`` hang (a server stuck in a tool), ``--add crash`` makes it kill
the server: the same tools, and so the same prompt, as the well-behaved server."""

from __future__ import annotations

import argparse
import os

import anyio
from mcp.server.fastmcp import FastMCP


def build(add_mode: str = "ok", port: int = 8000) -> FastMCP:
    server = FastMCP("asyncrl-test", host="127.0.0.1", port=port)

    @server.tool()
    async def add(a: int, b: int) -> int:
        """Add two numbers."""
        if add_mode == "hang":
            await anyio.sleep_forever()
        if add_mode == "crash":
            os._exit(3)
        return a + b

    @server.tool()
    async def sleep_forever() -> str:
        """Never return."""
        await anyio.sleep_forever()
        return ""

    @server.tool()
    def crash() -> str:
        """Kill the server."""
        os._exit(3)

    return server


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("transport", choices=["stdio", "http"])
    p.add_argument("port", type=int, nargs="?", default=8000)
    p.add_argument("--add", choices=["ok", "hang", "crash"], default="ok")
    a = p.parse_args()
    server = build(a.add, a.port)
    server.run("stdio" if a.transport == "stdio" else "streamable-http")


if __name__ == "__main__":
    main()
