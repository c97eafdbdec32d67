"""What a recorded conversation holds for replay: its prompt, the user's later turns, the tool calls with their
results, and the agent's answers.

The task is the whole conversation: the prompt is everything up to the first user turn (a run of user messages
counts as one turn), then the agent and the user take turns. The target is everything the agent did: every
call it made in every turn (the rubric requires the writes among them) and every answer (the facts they state
that tool results told it). Read as a single exchange (`whole=False`, no simulated user), the target ends at
the agent's first answer. Every recorded call of the conversation can answer the model either way.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from flywheel.contract import opening
from flywheel.envs.replay.matching import Call, normalise

# numbers, ids and dates: what an answer states that a tool told it ("W1234", "ORD-77", "2026-11-01", "1,234.50")
FACT = re.compile(r"\d{4}-\d{2}-\d{2}|\b[A-Za-z]+[-_]?\d[\w-]*|\d[\d,]*(?:\.\d+)?")
_JSON_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number", dict: "object", list: "array",
               type(None): "null"}


class UnusableRecord(ValueError):
    """A conversation replay cannot serve: a call whose arguments are not a JSON object, a result with no call."""


def call_arguments(call: dict) -> dict | None:
    """A tool call's arguments as a dict; None when they are not JSON or not a JSON object."""
    try:
        arguments = json.loads((call.get("function") or {}).get("arguments") or "{}")
    except json.JSONDecodeError:
        return None
    return arguments if isinstance(arguments, dict) else None


@dataclass
class Record:
    prompt: list[dict]
    calls: list[Call]  # every recorded call, in order
    users: list[dict]  # the user's turns after the prompt, in order (a run of user messages joined as one)
    answers: list[str]  # the agent's answers (assistant messages without tool calls) in the target, in order
    target: int  # how many of the calls the target holds (all of them for a whole conversation)
    facts: list[str]  # what the answers state that an earlier tool result told the agent, each once, in order

    @property
    def final(self) -> str:
        """The target's last answer ("" when there is none)."""
        return self.answers[-1] if self.answers else ""


def fact_list(text: str) -> list[str]:
    """The facts a text states, normalised (1,234.50 and 1234.5 are one fact), in order."""
    out = []
    for match in FACT.finditer(text or ""):
        value = normalise(match.group().rstrip(".-_"))
        out.append(str(value))
    return out


def facts_in(text: str) -> set[str]:
    """The set of facts a text states."""
    return set(fact_list(text))


def read_record(messages: list[dict], whole: bool = True) -> Record:
    """The prompt, user turns, calls, target, answers and facts of a normalised conversation (see the module)."""
    start = opening(messages)
    if start is None:
        raise UnusableRecord("the conversation has no user message")
    end = len(start) - 1  # the prompt runs on over user messages that follow the first one
    while end < len(messages) and messages[end].get("role") == "user":
        end += 1
    calls: list[Call] = []
    users: list[dict] = []
    answers: list[str] = []
    facts: dict[str, None] = {}
    pending: dict[str, tuple[str, dict]] = {}  # call id -> the call, for the latest assistant turn only
    target = None  # set where the target ends (whole: after the last message)
    previous = None
    for i, message in enumerate(messages[end:], end):
        role = message.get("role")
        if role == "assistant":
            pending = {}  # ids are unique within a turn only: agents reuse call_0 in every turn
            for call in message.get("tool_calls") or []:
                fn = call.get("function") or {}
                arguments = call_arguments(call)
                if not fn.get("name") or arguments is None:
                    raise UnusableRecord(f"message {i}: a tool call without a name or with arguments that are "
                                         "not a JSON object")
                pending[call.get("id")] = (fn["name"], arguments)
            if not message.get("tool_calls") and target is None:
                answer = _text(message.get("content"))
                answers.append(answer)
                told = facts_in(" ".join(c.result for c in calls))
                facts.update(dict.fromkeys(f for f in fact_list(answer) if f in told))
                if not whole:
                    target = len(calls)
        elif role == "tool":
            if message.get("tool_call_id") not in pending:
                raise UnusableRecord(f"message {i}: a tool result without its call")
            name, arguments = pending.pop(message["tool_call_id"])
            calls.append(Call(name, arguments, _text(message.get("content"))))
        elif role == "user":
            if not whole and target is None:
                target = len(calls)  # the user spoke again before any answer: the exchange ends there
            if whole:
                if previous == "user":  # a run of user messages is one turn
                    users[-1] = {"role": "user", "content": users[-1]["content"] + "\n" + _text(message.get("content"))}
                else:
                    users.append({"role": "user", "content": _text(message.get("content"))})
        previous = role
    return Record(messages[:end], calls, users, answers, len(calls) if target is None else target, list(facts))


def _text(content) -> str:
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def infer_tools(calls: list[Call]) -> list[dict]:
    """Function schemas for a trace that recorded none: each tool's name and its arguments' JSON types."""
    seen: dict[str, list[dict]] = {}
    for call in calls:
        seen.setdefault(call.name, []).append(call.arguments)
    schemas = []
    for name, uses in seen.items():
        properties: dict[str, dict] = {}
        for arguments in uses:
            for key, value in arguments.items():
                kinds = properties.setdefault(key, {"type": []})["type"]
                kind = _JSON_TYPES.get(type(value), "string")
                if kind not in kinds:
                    kinds.append(kind)
        for prop in properties.values():
            prop["type"] = prop["type"][0] if len(prop["type"]) == 1 else prop["type"]
        required = [k for k in properties if all(k in a for a in uses)]
        schemas.append({"type": "function", "function": {
            "name": name, "description": "A recorded tool (schema inferred from the calls it was given).",
            "parameters": {"type": "object", "properties": properties, "required": required}}})
    return schemas
