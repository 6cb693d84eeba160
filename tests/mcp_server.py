"""A tiny MCP server for the tool-environment tests (FastMCP from the ``mcp`` SDK).

``python tests/mcp_server.py stdio`` serves over stdio; ``... http FD`` over streamable HTTP on the
listening socket its parent passed as file descriptor FD (bound by the parent to port 0: a port
found free and bound later by the server could be taken in between by another test's server). ``--add hang`` makes ``add`` hang (a server stuck in a tool), ``--add crash`` makes it kill
the server: the same tools, and so the same prompt, as the well-behaved server."""

from __future__ import annotations

import argparse
import os
import socket

import anyio
from mcp.server.fastmcp import FastMCP


def build(add_mode: str = "ok") -> FastMCP:
    server = FastMCP("asyncrl-test")

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


async def serve_http(server: FastMCP, fd: int) -> None:
    """FastMCP's own streamable-HTTP run, on the inherited socket instead of a host and port."""
    import uvicorn

    app = server.streamable_http_app()
    await uvicorn.Server(uvicorn.Config(app, log_level="warning")).serve([socket.socket(fileno=fd)])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("transport", choices=["stdio", "http"])
    p.add_argument("fd", type=int, nargs="?", help="http: the listening socket's descriptor")
    p.add_argument("--add", choices=["ok", "hang", "crash"], default="ok")
    a = p.parse_args()
    server = build(a.add)
    if a.transport == "stdio":
        server.run("stdio")
    else:
        anyio.run(serve_http, server, a.fd)


if __name__ == "__main__":
    main()
