"""The desk's tools: typed functions over the episode's database, answering in compact JSON.

They do what they are asked and check only what the database itself can (an unknown id, an order already
cancelled): the policy in the system prompt is the agent's to follow, and the rubric checks it. Tool outputs
are short and regular on purpose: the demo student is a tiny model that has to read them.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Literal

from flywheel.contract import ToolError
from flywheel.envs.support.db import money

WRITES = ("cancel_order", "change_shipping", "refund_order", "transfer_to_human")


def _json(value: dict) -> str:
    return json.dumps(value, separators=(",", ":"))


def _order(state: sqlite3.Connection, order_id: str) -> tuple:
    row = state.execute("SELECT order_id, user_id, status, total_cents, shipping, payment FROM orders "
                        "WHERE order_id = ?", (order_id,)).fetchone()
    if row is None:
        raise ToolError(f"no order {order_id!r}")
    return row


def find_user(email: str, state: sqlite3.Connection) -> str:
    """Find a user by email.

    Args:
        email: the user's email address, e.g. ana.lee@mail.com
    """
    row = state.execute("SELECT user_id FROM users WHERE email = ?", (email.strip().lower(),)).fetchone()
    if row is None:
        raise ToolError(f"no user with email {email!r}")
    return _json({"user_id": row[0]})


def list_orders(user_id: str, state: sqlite3.Connection) -> str:
    """List the ids of a user's orders.

    Args:
        user_id: the user's id, e.g. U123
    """
    if state.execute("SELECT 1 FROM users WHERE user_id = ?", (user_id,)).fetchone() is None:
        raise ToolError(f"no user {user_id!r}")
    rows = state.execute("SELECT order_id FROM orders WHERE user_id = ? ORDER BY order_id", (user_id,)).fetchall()
    return _json({"orders": [r[0] for r in rows]})


def get_order(order_id: str, state: sqlite3.Connection) -> str:
    """Get an order's status, total, shipping speed and payment method.

    Args:
        order_id: the order's id, e.g. W1234
    """
    _, _, status, cents, shipping, payment = _order(state, order_id)
    return _json({"status": status, "total": money(cents), "shipping": shipping, "payment": payment})


def _close(state: sqlite3.Connection, order_id: str, status_after: str) -> str:
    """Cancel or refund: the order takes `status_after` and its total goes back to its payment method."""
    oid, _, status, cents, _, payment = _order(state, order_id)
    if status in ("cancelled", "refunded"):
        raise ToolError(f"order {oid} is already {status}")
    with state:
        state.execute("UPDATE orders SET status = ? WHERE order_id = ?", (status_after, oid))
        state.execute("INSERT INTO refunds VALUES (?, ?, ?)", (oid, cents, payment))
    return _json({"status": status_after, "refund": money(cents), "to": payment})


def cancel_order(order_id: str, state: sqlite3.Connection) -> str:
    """Cancel an order and refund its total to its payment method.

    Args:
        order_id: the order's id, e.g. W1234
    """
    return _close(state, order_id, "cancelled")


def refund_order(order_id: str, state: sqlite3.Connection) -> str:
    """Refund an order's total to its payment method.

    Args:
        order_id: the order's id, e.g. W1234
    """
    return _close(state, order_id, "refunded")


def change_shipping(order_id: str, speed: Literal["standard", "express"], state: sqlite3.Connection) -> str:
    """Change an order's shipping speed.

    Args:
        order_id: the order's id, e.g. W1234
        speed: the new shipping speed
    """
    oid, _, status, _, shipping, _ = _order(state, order_id)
    if status in ("cancelled", "refunded"):
        raise ToolError(f"order {oid} is {status}")
    if shipping == speed:
        raise ToolError(f"order {oid} already ships {speed}")
    with state:
        state.execute("UPDATE orders SET shipping = ? WHERE order_id = ?", (speed, oid))
    return _json({"shipping": speed})


def transfer_to_human(order_id: str, reason: Literal["damaged", "lost"], state: sqlite3.Connection) -> str:
    """Open a ticket for a human agent about an order.

    Args:
        order_id: the order's id, e.g. W1234
        reason: what went wrong with the package
    """
    oid = _order(state, order_id)[0]
    ticket = f"T{oid[1:]}"
    if state.execute("SELECT 1 FROM tickets WHERE ticket_id = ?", (ticket,)).fetchone():
        raise ToolError(f"ticket {ticket} is already open")
    with state:
        state.execute("INSERT INTO tickets VALUES (?, ?, ?)", (ticket, oid, reason))
    return _json({"ticket": ticket, "reason": reason})


TOOLS = [find_user, list_orders, get_order, cancel_order, change_shipping, refund_order, transfer_to_human]
BY_NAME = {fn.__name__: fn for fn in TOOLS}
