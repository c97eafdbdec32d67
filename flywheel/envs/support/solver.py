"""The desk's scripted oracle: the policy followed step by step from what the conversation shows.

It reads the request from the first user message and each tool result as a model would, and decides with the
same `decide` the tasks' answers come from. The episode's database is only a fallback: when a tool call failed
(a timeout on a loaded machine), the oracle reads the order from the state instead of giving up.

A hard message (several requests, one per order) is solved the same way, order by order: find_user, list_orders,
get_order for each of the user's orders it names, then every write the policy allows, then one answer that
joins what the policy says about each order.
"""

from __future__ import annotations

import json
import sqlite3

from flywheel.envs.support.db import money
from flywheel.envs.support.tasks import Request, decide, parse_requests


def _text(content: object) -> str:
    if isinstance(content, list):  # OpenAI content parts
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _call(name: str, **arguments) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function",
         "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def _say(text: str) -> dict:
    return {"role": "assistant", "content": text}


def tool_results(messages: list[dict]) -> dict[str, str]:
    """The latest result of each tool called so far, by tool name."""
    return {name: result for name, _, result in tool_calls(messages)}


def tool_calls(messages: list[dict]) -> list[tuple[str, dict, str]]:
    """Every tool call answered so far: (name, arguments, result).

    Results are paired with calls by id, else by position (recorded traces reuse or drop ids).
    """
    answered: list[tuple[str, dict, str]] = []
    waiting: list[dict] = []
    for m in messages:
        if m.get("role") == "assistant":
            waiting = list(m.get("tool_calls") or [])
        elif m.get("role") == "tool" and waiting:
            call = next((c for c in waiting if c.get("id") and c.get("id") == m.get("tool_call_id")), waiting[0])
            waiting.remove(call)
            fn = call.get("function", {})
            try:
                arguments = json.loads(fn.get("arguments") or "{}")
            except (json.JSONDecodeError, TypeError):  # not JSON text: a model's slip, or a trace's own form
                arguments = {}
            answered.append((fn.get("name", ""), arguments if isinstance(arguments, dict) else {},
                             _text(m.get("content"))))
    return answered


def _parsed(result: str | None) -> dict | None:
    try:
        value = json.loads(result) if result else None
    except json.JSONDecodeError:
        return None  # "Error: ..." from the harness or the tool
    return value if isinstance(value, dict) else None


def _order_in_state(state: sqlite3.Connection | None, order_id: str) -> dict | None:
    if state is None:
        return None
    row = state.execute("SELECT order_id, user_id, status, total_cents, shipping, payment FROM orders "
                        "WHERE order_id = ?", (order_id,)).fetchone()
    if row is None:
        return None
    return {"status": row[2], "total": money(row[3]), "shipping": row[4], "payment": row[5]}


def solve(messages: list[dict], state: sqlite3.Connection | None = None) -> dict:
    """The oracle's next assistant message: find_user, list_orders, get_order, the write if any, the reply."""
    first = next((_text(m.get("content")) for m in messages if m.get("role") == "user"), "")
    requests = parse_requests(first)
    if not requests:
        return _say("Please give me your email and the order id, and say what you need.")
    if len(requests) > 1:
        return _solve_hard(requests, messages, state)
    return answer_request(requests[0], messages, state)


def answer_request(request: Request, messages: list[dict], state: sqlite3.Connection | None = None) -> dict:
    """The next step on one request: find_user, list_orders, get_order, the write the policy allows, the reply."""
    results = tool_results(messages)
    step = _identify(request.email, results)
    if step is not None:
        return step
    listed = _parsed(results["list_orders"])
    owned = listed is not None and request.order_id in listed.get("orders", [])
    if not owned:
        return _say(decide(request, False, None)["reply"])
    if "get_order" not in results:
        return _call("get_order", order_id=request.order_id)
    order = _parsed(results["get_order"]) or _order_in_state(state, request.order_id)
    if order is None:
        return _say(f"I could not look up order {request.order_id}; please try again later.")
    decision = decide(request, True, order)
    pending = [(name, args) for name, args in decision["writes"] if name not in results]
    if pending:
        name, arguments = pending[0]
        return _call(name, **arguments)
    return _say(decision["reply"])


def _identify(email: str, results: dict[str, str]) -> dict | None:
    """The policy's first two steps, find_user by the email and then list_orders: the next one still to take (or
    the answer when the email is unknown), None once both are done."""
    if "find_user" not in results:
        return _call("find_user", email=email)
    user = _parsed(results["find_user"])
    if user is None:
        return _say(f"I could not find a user with the email {email}.")
    if "list_orders" not in results:
        return _call("list_orders", user_id=user["user_id"])
    return None


def _solve_hard(requests: list[Request], messages: list[dict], state: sqlite3.Connection | None) -> dict:
    """The next step on a message with several requests: the user, their orders, each of theirs looked up, every
    allowed write in the message's order, then one answer stating what the policy says about each order."""
    results = tool_results(messages)
    step = _identify(requests[0].email, results)
    if step is not None:
        return step
    listed = _parsed(results["list_orders"])
    owned = set(listed.get("orders", [])) if listed else set()
    answered = tool_calls(messages)
    looked_up = {arguments.get("order_id"): result for name, arguments, result in answered if name == "get_order"}
    decisions = []
    for request in requests:
        if request.order_id not in owned:
            decisions.append(decide(request, False, None))
            continue
        if request.order_id not in looked_up:
            return _call("get_order", order_id=request.order_id)
        order = _parsed(looked_up[request.order_id]) or _order_in_state(state, request.order_id)
        if order is None:
            return _say(f"I could not look up order {request.order_id}; please try again later.")
        decisions.append(decide(request, True, order))
    done = [(name, arguments) for name, arguments, _ in answered]
    for name, arguments in (w for d in decisions for w in d["writes"]):
        if (name, arguments) not in done:
            return _call(name, **arguments)
    return _say(" ".join(d["reply"] for d in decisions))
