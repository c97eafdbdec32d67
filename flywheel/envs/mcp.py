"""Tools from a Model Context Protocol server: listed at start, called per episode, the server owned here.

A tool source for an SDK environment: `Env(tool_sources=[McpServer(command=["python", "shop_server.py"])])` or
`McpServer(url="http://127.0.0.1:8000/mcp")` (streamable HTTP). The server's tool list becomes OpenAI function
schemas (its JSON schemas as they are); a call goes to the server and its text comes back as the tool result.
A server-side error (`isError`) or a failed call is a ToolError, so the model sees it as it would a Python tool's.

The `mcp` client is async and its streams belong to one event loop, while the harness calls tools from its
thread pool: so each server gets one thread running its own loop, holding the session open from `start()` to
`close()`, and calls are handed to that loop. A stdio server is a child process that `close()` (also run at
interpreter exit) stops; a URL server belongs to whoever started it, and only the session is closed.

MCP tools are shared by all episodes (one server, one session): per-episode state stays in the environment's
`setup`/Python tools, or in the server keyed by what the task gives it.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import shlex
import tempfile
import threading
from contextlib import AsyncExitStack
from datetime import timedelta

from flywheel.contract import ToolError
from flywheel.errors import UserFacingError

_CONFIG_KEYS = {"command", "url", "env", "cwd", "headers", "timeout_s", "startup_timeout_s"}


class McpError(UserFacingError, RuntimeError):
    """An MCP server could not be started, listed or reached (not a tool's own error, which is a ToolError)."""


class McpServer:
    """One MCP server as a tool source: a stdio command this object starts and stops, or a streamable-HTTP URL."""

    def __init__(self, command: list[str] | str | None = None, *, url: str | None = None,
                 env: dict[str, str] | None = None, cwd: str | None = None, headers: dict[str, str] | None = None,
                 timeout_s: float = 30.0, startup_timeout_s: float = 30.0):
        if (command is None) == (url is None):
            raise ValueError("an MCP server needs exactly one of `command` (stdio) or `url` (streamable HTTP)")
        self.command = shlex.split(command) if isinstance(command, str) else list(command or [])
        if command is not None and not self.command:
            raise ValueError("an MCP server's `command` is empty")
        self.url = url
        self.env, self.cwd, self.headers = env, cwd, headers
        # A backstop that frees the loop from a call nobody waits for any more; the harness's tool timeout
        # (shorter) is what the model sees.
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._session = None
        self._tools: list[dict] = []
        self._stderr = None

    @classmethod
    def from_config(cls, entry: str | dict) -> McpServer:
        """A server from config: a URL string, a command line string, or a mapping with `command` or `url`."""
        if isinstance(entry, str):
            if entry.startswith(("http://", "https://")):
                return cls(url=entry)
            return cls(command=entry)
        if not isinstance(entry, dict):
            raise ValueError(f"an MCP server entry must be a URL, a command or a mapping, not {type(entry).__name__}")
        unknown = sorted(set(entry) - _CONFIG_KEYS)
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} in MCP server entry (known: {sorted(_CONFIG_KEYS)})")
        return cls(**entry)

    @property
    def label(self) -> str:
        """What names this server in errors and logs: its URL or its command line."""
        return self.url or shlex.join(self.command)

    def __repr__(self) -> str:
        return f"McpServer({self.label!r})"

    # a process that receives this source (an RL actor) gets its config and starts its own server on first use
    def __getstate__(self) -> dict:
        return {"command": self.command or None, "url": self.url, "env": self.env, "cwd": self.cwd,
                "headers": self.headers, "timeout_s": self.timeout_s, "startup_timeout_s": self.startup_timeout_s}

    def __setstate__(self, config: dict) -> None:
        self.__init__(**config)

    def __enter__(self) -> McpServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Start the server (stdio) or connect (URL), and list its tools; a no-op when already started."""
        with self._lock:
            if self._thread is not None:
                if self._error is not None:
                    raise McpError(f"MCP server {self.label} failed earlier: {self._error}")
                return
            self._ready.clear()
            self._error = None
            self._thread = threading.Thread(target=asyncio.run, args=(self._hold(),), daemon=True,
                                            name=f"mcp {self.label}")
            self._thread.start()
            atexit.register(self.close)
        if not self._ready.wait(self.startup_timeout_s):
            stderr = self._stderr_tail()
            self.close()
            raise McpError(f"MCP server {self.label} did not answer within {self.startup_timeout_s}s{stderr}")
        if self._error is not None:
            error, stderr = self._error, self._stderr_tail()
            self.close()
            raise McpError(f"MCP server {self.label} could not be started: {_cause(error)}{stderr}") from error

    def tools(self) -> list[dict]:
        """The server's tools as OpenAI function schemas (listed once, at start)."""
        self.start()
        return [dict(t) for t in self._tools]

    def call_tool(self, name: str, arguments: dict, state: object = None) -> str:
        """Call one tool on the server; its error, or a failed call, is a ToolError the model sees."""
        self.start()
        if name not in {t["function"]["name"] for t in self._tools}:
            raise ToolError(f"unknown tool '{name}' on MCP server {self.label}")
        future = asyncio.run_coroutine_threadsafe(self._call(name, arguments), self._loop)
        try:
            result = future.result(timeout=self.timeout_s + 1.0)
        except TimeoutError:
            future.cancel()
            raise ToolError(f"tool '{name}' timed out after {self.timeout_s}s") from None
        except ToolError:
            raise
        except Exception as err:  # the session's own errors (a read timeout, a dropped connection)
            if getattr(getattr(err, "error", None), "code", None) == 408:  # the session's read timeout
                raise ToolError(f"tool '{name}' timed out after {self.timeout_s}s") from None
            raise ToolError(f"tool '{name}' failed on MCP server {self.label}: {_cause(err)}") from err
        return result

    def close(self) -> None:
        """End the session and stop a stdio server's process; safe to call twice."""
        with self._lock:
            thread, loop, stop = self._thread, self._loop, self._stop
            self._thread = None
        if thread is None:
            return
        if loop is not None and stop is not None and not loop.is_closed():
            # a session that is up closes in order on `stop`; one stuck starting is cancelled
            wake = stop.set if self._session is not None else self._task.cancel
            try:
                loop.call_soon_threadsafe(wake)
            except RuntimeError:  # the loop already ended (the session failed)
                pass
        # the stdio client waits up to 2 s for the process to exit after stdin closes, then kills its tree
        thread.join(timeout=10.0)
        atexit.unregister(self.close)
        self._session, self._loop, self._stop = None, None, None
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    async def _hold(self) -> None:
        """Open the transport and session, list the tools, then keep both open until close()."""
        self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
        self._stop = asyncio.Event()
        try:
            async with AsyncExitStack() as stack:
                from mcp import ClientSession

                read, write = await stack.enter_async_context(self._transport())
                session = await stack.enter_async_context(ClientSession(read, write))
                await session.initialize()
                self._tools = await self._list_tools(session)
                self._session = session
                self._ready.set()
                await self._stop.wait()
        except BaseException as err:  # handed to start(), which raises it in the caller's thread
            if not self._ready.is_set():
                self._error = err
        finally:
            self._ready.set()

    def _transport(self):
        """The client transport context: a child process over stdio, or streamable HTTP."""
        if self.url:
            import httpx
            from mcp.client.streamable_http import streamable_http_client

            client = httpx.AsyncClient(headers=self.headers, timeout=httpx.Timeout(30.0, read=300.0))
            return _two_streams(streamable_http_client(self.url, http_client=client), client)
        from mcp import StdioServerParameters
        from mcp.client.stdio import get_default_environment, stdio_client

        # the server's stderr goes to a file: readable in a startup error, and never into the model's stdio pipe
        self._stderr = tempfile.TemporaryFile(mode="w+", prefix="mcp-stderr-")
        # the MCP default environment (PATH, HOME, ...), not ours: a server gets no secret it was not given
        params = StdioServerParameters(command=self.command[0], args=self.command[1:], cwd=self.cwd,
                                       env={**get_default_environment(), **(self.env or {})})
        return _two_streams(stdio_client(params, errlog=self._stderr), None)

    async def _list_tools(self, session) -> list[dict]:
        """Every tool the server lists (all pages), as OpenAI function schemas."""
        tools, cursor = [], None
        while True:
            page = await session.list_tools(cursor=cursor)
            tools += [_openai_schema(t) for t in page.tools]
            cursor = page.nextCursor
            if not cursor:
                return tools

    async def _call(self, name: str, arguments: dict) -> str:
        """One tools/call on the held session, read as the text the model sees."""
        result = await self._session.call_tool(name, arguments,
                                               read_timeout_seconds=timedelta(seconds=self.timeout_s))
        text = _result_text(result)
        if result.isError:
            raise ToolError(text or f"tool '{name}' failed on MCP server {self.label}")
        return text

    def _stderr_tail(self) -> str:
        """The last lines the stdio server wrote to stderr, for an error message."""
        if self._stderr is None or self._stderr.closed:
            return ""
        self._stderr.flush()
        self._stderr.seek(0)
        tail = self._stderr.read()[-2000:].strip()
        return f"\nserver stderr:\n{tail}" if tail else ""


def mcp_servers(entries: list[str | dict] | None) -> list[McpServer]:
    """Servers from a config list (e.g. a factory's `args: {mcp: [...]}`), each a URL, a command or a mapping."""
    return [McpServer.from_config(entry) for entry in entries or []]


class _two_streams:
    """Both transports as one async context yielding (read, write), closing an httpx client we made."""

    def __init__(self, transport, client):
        self._transport, self._client = transport, client

    async def __aenter__(self):
        streams = await self._transport.__aenter__()
        return streams[0], streams[1]

    async def __aexit__(self, *exc):
        try:
            return await self._transport.__aexit__(*exc)
        finally:
            if self._client is not None:
                await self._client.aclose()


def _openai_schema(tool) -> dict:
    """An MCP tool listing as an OpenAI function schema (the server's JSON schema used as it is)."""
    parameters = dict(tool.inputSchema or {"type": "object", "properties": {}})
    parameters.setdefault("type", "object")
    parameters.setdefault("properties", {})
    return {"type": "function",
            "function": {"name": tool.name, "description": tool.description or "", "parameters": parameters}}


def _result_text(result) -> str:
    """A tools/call result as text: its text blocks joined, else its structured content as JSON."""
    parts = []
    for block in result.content:
        if getattr(block, "type", None) == "text":
            parts.append(block.text)
        else:  # images, audio, resources: the harness's messages carry text only
            parts.append(f"[{getattr(block, 'type', 'unknown')} content omitted]")
    if not parts and result.structuredContent is not None:
        parts.append(json.dumps(result.structuredContent, ensure_ascii=False))
    return "\n".join(parts)


def _cause(error: BaseException) -> str:
    """The innermost message of an error, unwrapping anyio's exception groups."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
