"""The desk's rubric: the final database against the expected one, the policy, and the facts of the answer.

Each part is a reward function `f(task, messages, state) -> float` the SDK logs in the breakdown; `resolved`,
the reward, is 1 only when all three hold: a wrong write, an extra write or a policy violation scores 0 however
good the answer reads. A hard task (several orders in one message) is scored the same way over all its writes;
each of its orders' facts must be stated where the answer speaks of that order.
"""

from __future__ import annotations

import functools
import json
import sqlite3

import flywheel.envs.support.db as database
from flywheel.contract import Task
from flywheel.envs.support.solver import _text
from flywheel.envs.support.tasks import SENTENCE
from flywheel.envs.support.tools import BY_NAME, WRITES


@functools.lru_cache(maxsize=4096)
def expected_snapshot(answer_json: str) -> dict[str, list[tuple]]:
    """The database as it must end: the seed's, with exactly the task's writes applied by the tools themselves.

    Cached by the task's answer text: every sample of a task (RL groups, the reward's parts) expects the same.
    """
    answer = json.loads(answer_json)
    conn = database.fresh(answer["db_seed"])
    try:
        for name, arguments in answer["writes"]:
            BY_NAME[name](**arguments, state=conn)
        return database.snapshot(conn)
    finally:
        conn.close()


def final_answer(messages: list[dict]) -> str | None:
    """The text of the last message when it is the assistant's answer (no tool calls); else None."""
    last = messages[-1] if messages else {}
    if last.get("role") != "assistant" or last.get("tool_calls"):
        return None
    return _text(last.get("content"))


def _calls(messages: list[dict]) -> list[tuple[str, dict]]:
    calls = []
    for m in messages:
        for call in (m.get("tool_calls") or []) if m.get("role") == "assistant" else []:
            fn = call.get("function", {})
            try:
                arguments = json.loads(fn.get("arguments") or "{}")
            except json.JSONDecodeError:
                arguments = None
            calls.append((fn.get("name", ""), arguments if isinstance(arguments, dict) else {}))
    return calls


def db_matches(task: Task, messages: list[dict], state: sqlite3.Connection) -> float:
    """1 when the episode's final database equals the expected one (no wrong, missing or extra write)."""
    return float(database.snapshot(state) == expected_snapshot(task.answer))


def policy_kept(task: Task, messages: list[dict], state: sqlite3.Connection) -> float:
    """1 when every write the agent attempted (failed ones too) is one the policy asks for, after finding the user.

    A write the policy forbids (an unconfirmed cancel, a refund of a pending order, another user's order) is a
    violation even when the tool refused it; so is any write before the user was found by their email.
    """
    answer = json.loads(task.answer)
    allowed = [(name, arguments) for name, arguments in answer["writes"]]
    email = answer["email"]
    found = False
    for name, arguments in _calls(messages):
        if name == "find_user" and str(arguments.get("email", "")).strip().lower() == email:
            found = True
        if name in WRITES:
            if not found or (name, arguments) not in allowed:
                return 0.0
            allowed.remove((name, arguments))
    return 1.0


def facts_stated(task: Task, messages: list[dict], state: sqlite3.Connection) -> float:
    """The share of the required facts the final answer states (each fact one of a few alternatives).

    A hard task's facts count only in the sentences about their own order (those naming it, and the ones after
    that name no order): "W1 is pending. W2 is not one of your orders." does not answer the task where it is the
    other way round."""
    text = (final_answer(messages) or "").lower()
    answer = json.loads(task.answer)
    required = answer["facts"]
    if not text or not required:
        return 0.0
    if "parts" not in answer:
        return sum(any(alt.lower() in text for alt in alternatives) for alternatives in required) / len(required)
    scopes = _scopes(text, [part["order_id"] for part in answer["parts"]])
    stated = sum(any(alt.lower() in scopes[part["order_id"]] for alt in alternatives)
                 for part in answer["parts"] for alternatives in part["facts"])
    return stated / len(required)


def _scopes(text: str, order_ids: list[str]) -> dict[str, str]:
    """The sentences of an answer about each order: those naming it, and those after them that name no order."""
    scopes = {oid: "" for oid in order_ids}
    about: list[str] = []
    for sentence in SENTENCE.split(text):
        about = [oid for oid in order_ids if oid.lower() in sentence] or about
        for oid in about:
            scopes[oid] += " " + sentence
    return scopes


def resolved(task: Task, messages: list[dict], state: sqlite3.Connection) -> float:
    """The reward: 1 when the database, the policy and every fact are right, else 0."""
    return float(db_matches(task, messages, state) == 1.0 and policy_kept(task, messages, state) == 1.0
                 and facts_stated(task, messages, state) == 1.0)
