"""Tool environments: where an episode's tool calls run (docs/design.md §6).

A :class:`ToolingEnv` lives for one episode (``initialise`` → ``list_tools`` / ``execute`` ... →
``close``), so a stateful tool (a sandbox, a browser session) is the episode's own. Two kinds:

- :class:`~asyncrl.agents.tools.LocalToolingEnv`: the recipe's Python functions (a
  :class:`ToolRegistry`).
- :class:`MCPToolingEnv`: MCP servers (the ``mcp`` SDK, optional extra ``agents``), one session per
  server per episode, over stdio (``mcp:stdio:<command line>``) or streamable HTTP
  (``mcp:http://host:port/mcp``). Each session runs in its own task and every call waits for it with
  the recipe's timeout, so a hung server is cut (its session closed, reopened at the next call) and
  a crashed one is an error result the model sees; neither stalls or ends the worker.

The ``mcp`` client is anyio-based and runs on trio, the worker's event loop.
"""

from __future__ import annotations

import contextlib
import shlex
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import trio

from asyncrl.agents.tools import ToolRegistry, load_tools
from asyncrl.contract import ToolCall, ToolingEnv, ToolResult  # ToolingEnv here too, for plugins
from asyncrl.plugins import PluginError

MCP_PREFIX = "mcp:"


@contextlib.asynccontextmanager
async def opened(env: ToolingEnv) -> AsyncIterator[ToolingEnv]:
    """``env`` initialised, and closed however the block ends."""
    await env.initialise()
    try:
        yield env
    finally:
        await env.close()


# ---- recipe specs (pure) ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MCPServer:
    """One MCP server: a command line to start over stdio, or a streamable-HTTP URL."""

    command: tuple[str, ...] = ()
    url: str = ""

    @property
    def label(self) -> str:
        return self.url or shlex.join(self.command)


def parse_mcp_spec(spec: str, *, key: str) -> MCPServer:
    """``mcp:stdio:<command line>`` or ``mcp:http(s)://...``; ``key`` names the recipe field."""
    rest = spec[len(MCP_PREFIX) :].strip()
    if rest.startswith(("http://", "https://")):
        return MCPServer(url=rest)
    if rest.startswith("stdio:"):
        try:
            cmd = shlex.split(rest[len("stdio:") :])
        except ValueError as e:
            raise PluginError(f"{key}: {spec!r}: the command line does not parse: {e}") from None
        if not cmd:
            raise PluginError(f"{key}: {spec!r}: no command after 'mcp:stdio:'")
        return MCPServer(command=tuple(cmd))
    raise PluginError(
        f"{key}: {spec!r} is not an MCP server: write 'mcp:stdio:<command line>' "
        "or 'mcp:http://host:port/path' (streamable HTTP)"
    )


def split_tool_specs(specs: list[str]) -> tuple[list[str], list[MCPServer]]:
    """``rollout.tools`` → (import paths of Python tools, MCP servers)."""
    local: list[str] = []
    servers: list[MCPServer] = []
    for i, spec in enumerate(specs):
        if spec.startswith(MCP_PREFIX):
            servers.append(parse_mcp_spec(spec, key=f"rollout.tools[{i}]"))
        else:
            local.append(spec)
    return local, servers


PYTHON_COMMANDS = ("python", "python3")


def stdio_command(command: tuple[str, ...]) -> tuple[str, ...]:
    """``command`` with a leading ``python`` or ``python3`` replaced by this process's interpreter:
    a server shipped with the worker's environment (``mcp:stdio:python -m asyncrl.agents.demo_agent``)
    must start in that environment, whatever ``PATH`` finds first (a launcher run as
    ``.venv/bin/asyncrl`` has no activated venv on its ``PATH``)."""
    if command and command[0] in PYTHON_COMMANDS:
        return (sys.executable, *command[1:])
    return command


def mcp_result_text(result: Any) -> str:
    """A ``CallToolResult``'s content as the text the model sees."""
    parts = []
    for c in result.content:
        text = getattr(c, "text", None)
        parts.append(text if isinstance(text, str) else f"[{getattr(c, 'type', 'content')}]")
    return "\n".join(parts)


def mcp_tool_schema(tool: Any) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description or "",
            "parameters": tool.inputSchema or {"type": "object", "properties": {}},
        },
    }


# ---- MCP sessions (I/O) ----------------------------------------------------------------------------


def _import_mcp() -> Any:
    try:
        import mcp
    except ImportError:
        raise PluginError(
            "rollout.tools names an MCP server, but the 'mcp' package is not installed "
            "(pip install 'asyncrl[agents]')"
        ) from None
    return mcp


@contextlib.asynccontextmanager
async def mcp_session(server: MCPServer) -> AsyncIterator[Any]:
    """An initialised ``mcp.ClientSession`` to ``server``."""
    mcp = _import_mcp()
    async with contextlib.AsyncExitStack() as stack:
        if server.url:
            from mcp.client.streamable_http import streamablehttp_client

            read, write, _ = await stack.enter_async_context(streamablehttp_client(server.url))
        else:
            from mcp.client.stdio import stdio_client

            cmd = stdio_command(server.command)
            params = mcp.StdioServerParameters(command=cmd[0], args=cmd[1:])
            read, write = await stack.enter_async_context(stdio_client(params))
        session = await stack.enter_async_context(mcp.ClientSession(read, write))
        await session.initialize()
        yield session


def _answered(e: Exception) -> bool:
    """Whether ``call_tool``'s exception is the server's answer (an MCP error other than the
    connection's end), after which the session is still good."""
    from mcp.shared.exceptions import McpError
    from mcp.types import CONNECTION_CLOSED

    return isinstance(e, McpError) and e.error.code != CONNECTION_CLOSED


def _describe(e: BaseException) -> str:
    if isinstance(e, BaseExceptionGroup):
        return "; ".join(_describe(x) for x in e.exceptions)
    return f"{type(e).__name__}: {e}"[:300]


class _Connection:
    """One server's session, run by its own task in the env's nursery: the session's failures end
    that task (recorded in ``error``), never the episode; the caller waits with a timeout."""

    def __init__(self, server: MCPServer, nursery: trio.Nursery) -> None:
        self.server = server
        self.nursery = nursery
        self.scope = trio.CancelScope()
        self.call_scope = trio.CancelScope()
        self.requests: trio.MemorySendChannel[tuple[ToolCall, trio.MemorySendChannel[Any]]]
        self.tools: list[Any] = []
        self.error = ""
        self.broken = False  # a call failed in the transport: the session is no use
        self.ready = trio.Event()
        self.ended = trio.Event()

    async def start(self, timeout_s: float) -> bool:
        """Open the session (and list its tools); False, with ``error``, if it did not open."""
        send, recv = trio.open_memory_channel[tuple[ToolCall, trio.MemorySendChannel[Any]]](0)
        self.requests = send
        self.nursery.start_soon(self._run, recv)
        with trio.move_on_after(timeout_s):
            async with trio.open_nursery() as n:

                async def first(ev: trio.Event) -> None:
                    await ev.wait()
                    n.cancel_scope.cancel()

                n.start_soon(first, self.ready)
                n.start_soon(first, self.ended)
        if not self.ready.is_set():
            self.error = self.error or f"no session within {timeout_s:g}s"
            self.stop()
            return False
        return True

    def stop(self) -> None:
        """End the session: a call in progress is cancelled and the session closes the MCP way (a
        stdio server gets its stdin closed, then a few seconds, then SIGTERM); a session still
        opening is cancelled outright."""
        if self.ready.is_set():
            self.call_scope.cancel()
            self.requests.close()
        else:
            self.scope.cancel()

    async def _run(self, requests: trio.MemoryReceiveChannel) -> None:
        try:
            with self.scope:
                async with mcp_session(self.server) as session, requests:
                    self.tools = list((await session.list_tools()).tools)
                    self.ready.set()
                    async for call, reply in requests:
                        self.call_scope = trio.CancelScope()  # a scope is entered once
                        with reply, self.call_scope:
                            try:
                                res: Any = await session.call_tool(call.name, call.arguments)
                            except Exception as e:  # the server's answer was an error
                                res = e
                            reply.send_nowait(res)
        except Exception as e:
            self.error = _describe(e)
        except BaseExceptionGroup as eg:  # cancellation mixed with the session's errors
            fatal = eg.subgroup(lambda x: not isinstance(x, Exception | trio.Cancelled))
            self.error = _describe(eg)
            if fatal is not None:
                raise fatal from None
        finally:
            self.error = self.error or "the session ended"
            self.ended.set()

    async def call(self, call: ToolCall, timeout_s: float) -> ToolResult:
        reply_send, reply_recv = trio.open_memory_channel[Any](1)
        res: Any = None
        with trio.move_on_after(timeout_s) as scope:
            try:
                await self.requests.send((call, reply_send))
                res = await reply_recv.receive()
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.EndOfChannel):
                why = self.error or "it closed the session"
                return ToolResult.failed(f"{call.name}: the MCP server failed: {why}")
        if scope.cancelled_caught:
            return ToolResult.failed(f"{call.name} timed out after {timeout_s:g}s", timed_out=True)
        if isinstance(res, Exception):
            self.broken = not _answered(res)
            return ToolResult.failed(f"{call.name}: {_describe(res)}")
        text = mcp_result_text(res)
        if res.isError:
            return ToolResult.failed(f"{call.name}: {text}")
        return ToolResult(text=text)


class MCPToolingEnv:
    """MCP servers' tools (and the recipe's Python tools, ``local``) for one episode.

    A call that times out or whose session failed closes that server's session; the next call to
    it opens a new one (``stats["session_restarts"]``)."""

    def __init__(
        self,
        servers: list[MCPServer],
        *,
        timeout_s: float = 30.0,
        local: ToolRegistry | None = None,
        stats: dict[str, int] | None = None,
        connect_timeout_s: float = 60.0,
    ) -> None:
        self.servers = servers
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s  # starting a server is slower than a call
        self.local = local or ToolRegistry([], timeout_s=timeout_s)
        self.stats = stats if stats is not None else {}
        self._stack = contextlib.AsyncExitStack()
        self._nursery: trio.Nursery | None = None
        self._conns: dict[MCPServer, _Connection] = {}
        self._owner: dict[str, MCPServer] = {}
        self._schemas: list[dict[str, Any]] = []
        self._last_error = ""

    async def initialise(self) -> None:
        """Open every server's session and list its tools; a server that does not answer raises
        (the episode fails and is counted, as an engine that does not answer would)."""
        self._nursery = await self._stack.enter_async_context(trio.open_nursery())
        try:
            schemas = self.local.schemas()
            for server in self.servers:
                conn = await self._connect(server)
                if conn is None:
                    raise RuntimeError(f"MCP server {server.label}: {self._last_error}")
                for t in conn.tools:
                    self._owner.setdefault(t.name, server)
                    schemas.append(mcp_tool_schema(t))
        except BaseException:
            await self.close()  # the nursery must not outlive this task's frame
            raise
        self._schemas = schemas

    async def _connect(self, server: MCPServer) -> _Connection | None:
        assert self._nursery is not None, "initialise() first"
        conn = _Connection(server, self._nursery)
        if not await conn.start(self.connect_timeout_s):
            self._last_error = conn.error
            return None
        self._conns[server] = conn
        return conn

    def list_tools(self) -> list[dict[str, Any]]:
        return list(self._schemas)

    async def execute(self, call: ToolCall) -> ToolResult:
        t0 = trio.current_time()
        server = self._owner.get(call.name)
        if server is None and call.name not in self.local.tools and "_error" not in call.arguments:
            names = ", ".join(s["function"]["name"] for s in self._schemas)
            r = ToolResult.failed(f"no tool named {call.name!r} (tools: {names})")
        elif server is None or "_error" in call.arguments:
            r = await self.local.execute(call)
        else:
            r = await self._execute(server, call)
        r.seconds = trio.current_time() - t0
        self.stats["calls"] = self.stats.get("calls", 0) + 1
        if not r.ok:
            self.stats["errors"] = self.stats.get("errors", 0) + 1
        if r.timed_out:
            self.stats["timeouts"] = self.stats.get("timeouts", 0) + 1
        return r

    async def _execute(self, server: MCPServer, call: ToolCall) -> ToolResult:
        conn = self._conns.get(server)
        if conn is None or conn.ended.is_set():
            self._conns.pop(server, None)
            if conn is not None:
                self.stats["session_restarts"] = self.stats.get("session_restarts", 0) + 1
            conn = await self._connect(server)
            if conn is None:
                return ToolResult.failed(f"{call.name}: MCP server unavailable: {self._last_error}")
        r = await conn.call(call, self.timeout_s)
        if not r.ok and (r.timed_out or conn.broken or conn.ended.is_set()):
            conn.stop()  # a hung call holds the session: drop it, the next call reopens
            self._conns.pop(server, None)
            self.stats["session_restarts"] = self.stats.get("session_restarts", 0) + 1
        return r

    async def close(self) -> None:
        for conn in self._conns.values():
            conn.stop()
        self._conns.clear()
        await self._stack.aclose()  # waits for the sessions' shutdown
        self._nursery = None


# ---- the recipe's tool set -------------------------------------------------------------------------


class ToolSet:
    """``rollout.tools`` for a worker: opens each episode's :class:`ToolingEnv` and lists the tools
    for the prompt's chat template (MCP servers' listed once, at the first prompt)."""

    def __init__(
        self,
        registry: ToolRegistry,
        servers: list[MCPServer] | None = None,
    ) -> None:
        self.registry = registry
        self.servers = servers or []
        self.stats: dict[str, int] = {}
        self._schemas: list[dict[str, Any]] | None = None
        self._lock = trio.Lock()

    @classmethod
    def from_specs(cls, specs: list[str], *, timeout_s: float = 30.0) -> ToolSet:
        local, servers = split_tool_specs(specs)
        if servers:
            _import_mcp()
        return cls(ToolRegistry(load_tools(local), timeout_s=timeout_s), servers)

    @property
    def timeout_s(self) -> float:
        return self.registry.timeout_s

    def open(self) -> ToolingEnv:
        if not self.servers:
            return self.registry.open()
        return MCPToolingEnv(
            self.servers, timeout_s=self.timeout_s, local=self.registry, stats=self.stats
        )

    async def schemas(self) -> list[dict[str, Any]]:
        if not self.servers:
            return self.registry.schemas()
        async with self._lock:
            if self._schemas is None:
                async with opened(self.open()) as env:
                    self._schemas = env.list_tools()
        return list(self._schemas)
