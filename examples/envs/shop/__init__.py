"""An order desk: the environment a user copies to train their own agent (README "Your own agent").

Two typed tools over a per-episode SQLite database, tasks from tasks.jsonl next to this file, a rubric (the
database ends as it should and the answer states the order's status; each part logged) and a scripted solver
the oracle teacher runs. Copied into your project as envs/shop/, a pipeline uses it as `environment: {factory:
"envs.shop:make_env"}` (the project root is importable); in this repository it is "examples.envs.shop:make_env"
(tests/test_example_env.py runs the whole loop on it, and `flywheel check PIPELINE --solve` dry-runs it).
"""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path
from typing import Literal

from flywheel.envs.sdk import Env, Reward, Task, ToolError, tasks_from_file

STATUSES = ("processing", "shipped", "delivered")
ITEMS = ("kettle", "lamp", "backpack", "headphones", "blender", "chair", "jacket")


def order_rows() -> list[tuple[str, str, str]]:
    """The shop's orders (id, item, status): the same fresh database for every episode."""
    return [(f"O-{1000 + i}", ITEMS[i % len(ITEMS)], STATUSES[i % len(STATUSES)]) for i in range(80)]


def fresh_db(task: Task) -> sqlite3.Connection:
    """The episode's own database (tools run in the harness's threads: check_same_thread=False)."""
    db = sqlite3.connect(":memory:", check_same_thread=False)
    db.execute("CREATE TABLE orders (id TEXT PRIMARY KEY, item TEXT, status TEXT, refund_reason TEXT)")
    db.executemany("INSERT INTO orders VALUES (?, ?, ?, NULL)", order_rows())
    return db


def lookup_order(order_id: str, state: sqlite3.Connection) -> str:
    """Look up an order by its id.

    Args:
        order_id: the order's id, e.g. "O-1001"
    """
    row = state.execute("SELECT id, item, status FROM orders WHERE id = ?", (order_id,)).fetchone()
    if row is None:
        raise ToolError(f"no order '{order_id}'")
    return json.dumps({"id": row[0], "item": row[1], "status": row[2]})


def refund(order_id: str, reason: Literal["damaged", "late", "unwanted"], state: sqlite3.Connection) -> str:
    """Refund a delivered order.

    Args:
        order_id: the order's id
        reason: why the customer wants the money back
    """
    row = state.execute("SELECT status FROM orders WHERE id = ?", (order_id,)).fetchone()
    if row is None:
        raise ToolError(f"no order '{order_id}'")
    if row[0] != "delivered":
        raise ToolError(f"order {order_id} is {row[0]}: only delivered orders can be refunded")
    state.execute("UPDATE orders SET status = 'refunded', refund_reason = ? WHERE id = ?", (reason, order_id))
    return json.dumps({"id": order_id, "status": "refunded"})


def correct_state(task: Task, messages: list[dict], state: sqlite3.Connection) -> float:
    """1 if exactly the expected orders were refunded, nothing else."""
    refunded = {r[0] for r in state.execute("SELECT id FROM orders WHERE status = 'refunded'")}
    return float(refunded == set(task.data["refunded"]))


def states_status(task: Task, messages: list[dict], state: sqlite3.Connection) -> float:
    """1 if the final answer names the order's status as it ends."""
    last = messages[-1] if messages else {}
    final = last.get("content") or "" if last.get("role") == "assistant" and not last.get("tool_calls") else ""
    return float(task.data["status"] in final.lower())


def resolved(task: Task, messages: list[dict], state: sqlite3.Connection) -> float:
    """The reward: 1 when the answer names the status and exactly the right orders were refunded. Both at once:
    with the two parts weighted apart, an empty answer would earn the untouched database's part on every look-up
    task (`flywheel check --solve` warns of such a rubric)."""
    return correct_state(task, messages, state) * states_status(task, messages, state)


def solve(messages: list[dict], state: sqlite3.Connection) -> dict:
    """The scripted agent: look the order up, refund it when asked and allowed, then say its status."""
    question = next(m["content"] for m in messages if m["role"] == "user")
    order_id = re.search(r"O-\d{4}", question).group(0)
    results = [json.loads(m["content"]) for m in messages if m["role"] == "tool" and m["content"].startswith("{")]
    if not results:
        return _call("lookup_order", {"order_id": order_id})
    wants = re.search(r"(damaged|late|unwanted)", question)
    if wants and results[-1]["status"] == "delivered":
        return _call("refund", {"order_id": order_id, "reason": wants.group(1)})
    return {"role": "assistant", "content": f"Order {order_id} is {results[-1]['status']}."}


def _call(name: str, arguments: dict) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def make_env() -> Env:
    """The order desk (pipelines.yaml: environment: {factory: "envs.shop:make_env"} once copied to envs/shop/)."""
    return Env(
        name="shop",
        tools=[lookup_order, refund],
        tasks=tasks_from_file(Path(__file__).parent / "tasks.jsonl"),
        # the reward is `resolved` alone; its two parts are logged beside it (weight 0) to show what went wrong
        rewards=[Reward(resolved, weight=1.0), Reward(correct_state, weight=0.0), Reward(states_status, weight=0.0)],
        passed=1.0,
        setup=fresh_db,
        teardown=sqlite3.Connection.close,
        solver=solve,
    )
