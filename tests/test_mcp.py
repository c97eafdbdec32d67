"""MCP tools against a real server (tests/mcp_server.py, written with the mcp package's FastMCP), over stdio and
over streamable HTTP on loopback: listing, calls through the harness, errors and hangs the model sees, and the
server's process stopped with the environment."""

from __future__ import annotations

import copy
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flywheel.agent import Harness, Limits
from flywheel.contract import Environment, Score, Task, ToolError
from flywheel.envs.mcp import McpError, McpServer, mcp_servers
from flywheel.policies.base import Completion

SERVER = Path(__file__).with_name("mcp_server.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def http_url(tmp_path_factory):
    """The test server over streamable HTTP on loopback, in its own process (the environment does not own it)."""
    port = _free_port()
    log = tmp_path_factory.mktemp("mcp") / "server.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, str(SERVER), "http", str(port)], stdout=out, stderr=out)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"MCP test server did not start:\n{log.read_text()}") from None
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}/mcp"
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture(params=["stdio", "http"])
def server(request) -> McpServer:
    """One started MCP tool source per transport; closed after the test."""
    if request.param == "stdio":
        source = McpServer([sys.executable, str(SERVER), "stdio"], timeout_s=2.0)
    else:
        source = McpServer(url=request.getfixturevalue("http_url"), timeout_s=2.0)
    with source:
        yield source


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead but still listed until reaped
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def test_tools_are_listed_as_openai_function_schemas(server):
    tools = {t["function"]["name"]: t for t in server.tools()}
    assert set(tools) == {"order_status", "add", "slow", "pid"}
    add = tools["add"]
    assert add["type"] == "function"
    assert add["function"]["description"] == "Add two integers."
    params = add["function"]["parameters"]
    assert params["type"] == "object"
    assert params["properties"]["a"]["type"] == "integer" and params["properties"]["b"]["type"] == "integer"
    assert sorted(params["required"]) == ["a", "b"]
    assert tools["pid"]["function"]["parameters"]["properties"] == {}


def test_calls_return_the_servers_text_and_its_errors_are_tool_errors(server):
    assert server.call_tool("add", {"a": 2, "b": 40}) == "42"
    assert server.call_tool("order_status", {"order_id": "O-1001"}) == "shipped"
    with pytest.raises(ToolError, match="no order O-9"):  # the tool raised on the server
        server.call_tool("order_status", {"order_id": "O-9"})
    with pytest.raises(ToolError, match="valid integer"):  # the server validated the arguments
        server.call_tool("add", {"a": "two", "b": 1})
    with pytest.raises(ToolError, match="unknown tool 'refund'"):
        server.call_tool("refund", {})
    with pytest.raises(ToolError, match="timed out after 2.0s"):
        server.call_tool("slow", {"seconds": 30})
    # the session outlives a hang and an error: the next call is answered
    assert server.call_tool("add", {"a": 1, "b": 1}) == "2"


class Scripted:
    """A policy that plays fixed assistant turns, the same in every conversation."""

    name = "scripted"

    def __init__(self, turns: list[dict]):
        self.turns = turns

    def generate(self, conversations, tools, sampling):
        turn = sum(m["role"] == "assistant" for m in conversations[0])
        return [Completion(message=copy.deepcopy(self.turns[turn])) for _ in conversations]


def _calls(*calls: tuple[str, dict]) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        for name, args in calls]}


class McpOnlyEnv(Environment):
    """The smallest environment whose tools are all an MCP server's: what the harness sees of a tool source."""

    name = "mcp-shop"

    def __init__(self, source: McpServer):
        self.source = source

    def tools(self):
        return self.source.tools()

    def generate_tasks(self, seed):
        return iter(())

    def call_tool(self, name, arguments, state=None):
        return self.source.call_tool(name, arguments, state)

    def score(self, task, messages, state=None):
        ok = json.loads(task.answer)["status"] in (messages[-1].get("content") or "")
        return Score(reward=float(ok), passed=ok)


def test_the_harness_runs_episodes_on_mcp_tools_with_its_timeout_and_errors(server):
    env = McpOnlyEnv(server)
    task = Task(task_id="t1", env=env.name, prompt=[{"role": "user", "content": "Where is order O-1001?"}],
                answer=json.dumps({"status": "shipped"}), slice="mcp")
    policy = Scripted([
        _calls(("order_status", {"order_id": "O-1001"}), ("order_status", {"order_id": "O-9"}),
               ("add", {"a": 2, "b": 3})),
        _calls(("slow", {"seconds": 1.5})),
        {"role": "assistant", "content": "Order O-1001 has shipped."},
    ])
    episodes = Harness(env, Limits(max_turns=4, tool_timeout_s=0.5)).run(policy, [task], samples=3)
    assert len(episodes) == 3
    for episode in episodes:
        results = [m["content"] for m in episode.messages if m["role"] == "tool"]
        assert results[0] == "shipped"
        assert results[1].startswith("Error: ") and "no order O-9" in results[1]
        assert results[2] == "5"
        assert results[3] == "Error: tool 'slow' timed out after 0.5s"  # the harness's timeout, as for Python tools
        assert episode.stop == "answer" and episode.turns == 3  # the episode went on after the error and the hang
        assert episode.reward == 1.0 and episode.passed


def test_a_stdio_server_is_started_and_stopped_by_its_owner():
    source = McpServer([sys.executable, str(SERVER), "stdio"])
    with source:
        pid = int(source.call_tool("pid", {}).split()[0])
        assert pid != os.getpid() and _alive(pid)
        source.call_tool("order_status", {"order_id": "O-1002"})
        assert source.call_tool("pid", {}) == f"{pid} 1"  # one process serves every call of the session
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "the MCP server's process outlived close()"
    source.close()  # twice is fine
    # a later use starts a fresh process
    with source:
        assert int(source.call_tool("pid", {}).split()[0]) != pid


def test_a_server_that_cannot_start_is_an_error_naming_it_and_its_stderr(tmp_path):
    crash = tmp_path / "crash.py"
    crash.write_text("import sys\nprint('missing SHOP_DB setting', file=sys.stderr)\nsys.exit(3)\n")
    with pytest.raises(McpError, match=r"(?s)crash\.py could not be started.*missing SHOP_DB setting"):
        McpServer([sys.executable, str(crash)]).tools()
    with pytest.raises(McpError, match="no-such-mcp-server.*could not be started"):
        McpServer(["no-such-mcp-server"]).start()
    url = f"http://127.0.0.1:{_free_port()}/mcp"  # nothing listens there
    with pytest.raises(McpError, match=re.escape(url) + " could not be started: ConnectError"):
        McpServer(url=url).start()


def test_config_entries_name_a_command_or_a_url():
    stdio, http, mapping = mcp_servers(["python -m shop_mcp --db 'a b.db'", "http://127.0.0.1:9/mcp",
                                        {"command": ["node", "server.js"], "env": {"TOKEN": "x"}, "timeout_s": 5}])
    assert stdio.command == ["python", "-m", "shop_mcp", "--db", "a b.db"] and stdio.url is None
    assert http.url == "http://127.0.0.1:9/mcp" and http.command == []
    assert mapping.command == ["node", "server.js"] and mapping.env == {"TOKEN": "x"} and mapping.timeout_s == 5
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['cmd'\]"):
        McpServer.from_config({"cmd": "x"})
    with pytest.raises(ValueError, match="exactly one of `command`"):
        McpServer.from_config({"command": "x", "url": "http://h/mcp"})


def note(text: str) -> str:
    """Write a note for the human agent.

    Args:
        text: what to write
    """
    return f"noted: {text}"


def says_the_status(task, messages, state) -> float:
    """1 when the final answer states the order's status."""
    return float(json.loads(task.answer)["status"] in (messages[-1].get("content") or ""))


def test_an_sdk_env_takes_tools_from_an_mcp_server_next_to_python_tools(server):
    from flywheel.envs.sdk import Env

    task = Task(task_id="t2", env="shop", prompt=[{"role": "user", "content": "Where is order O-1002?"}],
                answer=json.dumps({"status": "pending"}), slice="mcp")
    env = Env(name="shop", tools=[note], tasks=lambda seed: iter([task]), rewards=[says_the_status],
              tool_sources=[server])
    names = [t["function"]["name"] for t in env.tools()]
    assert names == ["note", "order_status", "add", "slow", "pid"]  # Python tools first, then the server's
    policy = Scripted([
        _calls(("order_status", {"order_id": "O-1002"}), ("order_status", {"order_id": "O-9"}),
               ("note", {"text": "asked"})),
        _calls(("slow", {"seconds": 1.5})),
        {"role": "assistant", "content": "Order O-1002 is pending."},
    ])
    episodes = Harness(env, Limits(max_turns=4, tool_timeout_s=0.5)).run(policy, [task], samples=2)
    for episode in episodes:
        results = [m["content"] for m in episode.messages if m["role"] == "tool"]
        assert results[0] == "pending" and "no order O-9" in results[1] and results[2] == "noted: asked"
        assert results[3] == "Error: tool 'slow' timed out after 0.5s"
        assert episode.stop == "answer" and episode.reward == 1.0 and episode.passed
    counters = env.counters
    assert counters["tool_calls"] == 8 and counters["tool_timeouts"] == 2
    assert counters["tool_refusals"] + counters["tool_errors"] == 2  # the server's error, once per episode


def test_a_server_pickles_as_its_config_and_starts_again_where_it_lands():
    import pickle

    with McpServer([sys.executable, str(SERVER), "stdio"], timeout_s=3.0) as source:
        pid = source.call_tool("pid", {}).split()[0]
        copy_ = pickle.loads(pickle.dumps(source))  # what an RL actor in another process receives
    with copy_:
        assert copy_.timeout_s == 3.0 and copy_.call_tool("add", {"a": 1, "b": 2}) == "3"
        assert copy_.call_tool("pid", {}).split()[0] != pid  # its own server process
