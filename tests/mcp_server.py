"""A small MCP server written with the mcp package's own FastMCP, for tests: `python mcp_server.py stdio` or
`python mcp_server.py http PORT` (streamable HTTP on 127.0.0.1:PORT/mcp)."""

from __future__ import annotations

import os
import sys

import anyio
from mcp.server.fastmcp import FastMCP

server = FastMCP("shop", host="127.0.0.1", port=int(sys.argv[2]) if len(sys.argv) > 2 else 8000)
ORDERS = {"O-1001": "shipped", "O-1002": "pending"}
calls = 0


@server.tool()
def order_status(order_id: str) -> str:
    """Look up the status of an order by its id."""
    global calls
    calls += 1
    if order_id not in ORDERS:
        raise ValueError(f"no order {order_id}")
    return ORDERS[order_id]


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
async def slow(seconds: float) -> str:
    """Sleep, then answer (a tool that hangs)."""
    await anyio.sleep(seconds)
    return "done"


@server.tool()
def pid() -> str:
    """The server's process id and how many order lookups it served, as 'pid calls'."""
    return f"{os.getpid()} {calls}"


if __name__ == "__main__":
    server.run(transport="streamable-http" if sys.argv[1] == "http" else "stdio")
