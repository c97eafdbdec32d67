"""One record as a traces-table row: its messages normalised and checked, redacted, its trace id and split derived.

A record that cannot be a row raises BadRecord with its reason (collection.py quarantines it).
"""

from __future__ import annotations

import hashlib
import json
import re

import orjson

from flywheel.config import CollectConfig, SourceConfig
from flywheel.contract import conversation_hash, split_of
from flywheel.data.redaction import Redactor
from flywheel.data.shapes import _MISSING, BadRecord, extract, get_path
from flywheel.data.turns import chat_messages

__all__ = ["JSON_SORTED", "BadRecord", "normalise_messages", "redact_location", "to_trace", "to_trace_parts",
           "unknown_actions"]

ROLES = {"system", "user", "assistant", "tool"}
_ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role
# what shapes.timestamp() makes of a time it could read; anything else is the record's own text
_ISO_UTC = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d{3})?Z")
# json.dumps(value, ensure_ascii=False, ...) builds an encoder per call; these are the same encoders, built once
# (JSON_SORTED writes a row's metadata: tracetable.join_labels writes a joined label's with it too)
_JSON_TEXT = json.JSONEncoder(ensure_ascii=False).encode
JSON_SORTED = json.JSONEncoder(sort_keys=True, ensure_ascii=False, default=str).encode


def normalise_messages(messages, open_end: bool = False) -> list[dict]:
    """OpenAI chat messages with only the keys that matter, each tool call answered by id, in call order.

    `open_end`: the last message's tool calls may be unanswered (a call that ended in them, kept for its label).
    """
    if not isinstance(messages, list):
        raise BadRecord("wrong_type", "messages is not a list")
    if not messages:
        raise BadRecord("empty", "empty conversation")
    out: list[dict] = []
    pending: dict[str, int] = {}  # call id -> its position among the open calls
    results: list[dict] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRecord("wrong_type", f"message {i} is not an object")
        role = message.get("role")
        role = _ROLE_ALIASES.get(role, role)
        if role not in ROLES:
            raise BadRecord("unknown_role", f"message {i} has unknown role {role!r}")
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in pending:
                raise BadRecord("orphan_tool_result", f"message {i} is a tool result without a matching call "
                                                      f"({call_id!r})")
            results.append({"role": "tool", "tool_call_id": call_id, "content": _text(message.get("content"), i)})
            continue
        if pending:
            _close(out, pending, results, before=i)
        content = _text(message.get("content"), i)
        if role == "assistant" and message.get("tool_calls"):
            calls = [_call(call, i) for call in _list(message["tool_calls"], f"message {i} tool_calls")]
            pending = {call["id"]: n for n, call in enumerate(calls)}
            if len(pending) < len(calls):
                raise BadRecord("bad_tool_call", f"message {i} has two tool calls with one id")
            out.append({"role": role, "content": content or None, "tool_calls": calls})
        else:
            out.append({"role": role, "content": content})
    if pending and not (open_end and not results):
        _close(out, pending, results, before=None)
    if not any(m["role"] == "user" for m in out):
        raise BadRecord("no_user_message", "conversation has no user message")
    return out


def _close(out: list[dict], pending: dict[str, int], results: list[dict], before: int | None) -> None:
    # The results of one assistant turn, in the order of its calls (logs often write them as they finish).
    answered = {r["tool_call_id"] for r in results}
    missing = [c for c in pending if c not in answered]
    if missing:
        where = f"before message {before}" if before is not None else "at the end"
        raise BadRecord("unanswered_tool_call", f"tool call {missing[0]!r} has no result {where}")
    if len(results) > len(pending):
        raise BadRecord("orphan_tool_result", f"tool call {results[0]['tool_call_id']!r} has two results")
    out.extend(sorted(results, key=lambda r: pending[r["tool_call_id"]]))
    pending.clear()
    results.clear()


def _text(content, i: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRecord("wrong_type", f"message {i} has a content part that is not text ({kind!r})")
            texts.append(part["text"])
        return "\n".join(texts)
    raise BadRecord("wrong_type", f"message {i} content is not text")


def _list(value, what: str) -> list:
    if not isinstance(value, list):
        raise BadRecord("wrong_type", f"{what} is not a list")
    return value


def _call(call, i: int) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not call.get("id") or not isinstance(function.get("name"), str):
        raise BadRecord("bad_tool_call", f"message {i} has a tool call without id or function name")
    # A target with such a call would teach the model to emit it, and replay could not serve it: each its own kind.
    if not function["name"].strip():
        raise BadRecord("empty_tool_name", f"message {i} has a tool call with an empty function name")
    arguments = function.get("arguments")
    if arguments is None:
        arguments = "{}"
    elif not isinstance(arguments, str):  # some loggers keep the parsed object
        if not isinstance(arguments, dict):
            raise BadRecord("tool_arguments_not_object", f"message {i}: tool call {function['name']!r} has "
                                                         f"arguments that are not a JSON object")
        arguments = json.dumps(arguments, ensure_ascii=False)
    else:
        try:
            parsed = orjson.loads(arguments) if arguments.strip() else {}
        except orjson.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise BadRecord("tool_arguments_not_object", f"message {i}: tool call {function['name']!r} has "
                                                         f"arguments that are not a JSON object")
    return {"id": str(call["id"]), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def to_trace(record: dict, source: SourceConfig, location: str, cfg: CollectConfig, redactor: Redactor,
             label: str | None = None) -> dict:
    """One traces-table row, redacted; raise BadRecord with the reason otherwise (PartialTurn: skip it).

    `label`, the source's label, saves deriving it again for every record.
    """
    return to_trace_parts(record, source, location, cfg, redactor, label)[0]


def to_trace_parts(record: dict, source: SourceConfig, location: str, cfg: CollectConfig, redactor: Redactor,
              label: str | None) -> tuple[dict, list[dict], tuple[str, ...]]:
    """to_trace's row, its messages as a list (what json.loads of the row's `messages` gives), and the fields
    the config names that the record lacks (scenario, expected_actions, group)."""
    parts = extract(record, source)
    raw = parts.messages if source.turns is None else chat_messages(parts.messages, source.turns)
    messages, tools = normalise_messages(raw, open_end=parts.partial), _list(parts.tools, "tools")
    tools_text = _tools_text(tools)
    # Gated first, as one text, since most records have nothing to redact: the strings of the messages (their
    # shape is normalise_messages's), the tool list as its text (which holds all its strings), the rest
    scrub = _unchanged
    scenario, expected = parts.scenario, parts.expected_actions
    group = _group(record, cfg.group_by)
    if redactor.needed_in(_message_strings(messages), tools_text, parts.metadata, parts.record_id, scenario,
                          expected, group):
        scrub = redactor.value
        messages, tools = scrub(messages), scrub(tools)
        tools_text = _tools_text(tools)
        scenario, expected, group = scrub(scenario), scrub(expected), scrub(group)
    metadata = scrub(parts.metadata)  # keeps the record's time field as it was, redacted like the rest
    # collected_at holds a time or nothing: text that is no time may be anything (a name, an address)
    collected_at = parts.time if _ISO_UTC.fullmatch(parts.time) else ""
    messages_text = _JSON_TEXT(messages)
    metadata_text = JSON_SORTED(metadata)
    size = len(messages_text) + len(tools_text) + len(metadata_text)
    if size > cfg.max_record_bytes:
        raise BadRecord("oversize", f"record is {size} characters, over max_record_bytes {cfg.max_record_bytes}")
    body = f'{{"messages": {messages_text}, "tools": {tools_text}}}'
    record_id = scrub(parts.record_id)
    try:  # JSON's escapes can spell a lone surrogate, which no UTF-8 text (the hash, Parquet) can hold
        trace_id = hashlib.sha256(body.encode()).hexdigest()[:16]
        metadata_text.encode()
        record_id.encode()
    except UnicodeEncodeError as err:
        raise BadRecord("not_unicode", f"a string holds {err.object[err.start]!r}, an unpaired surrogate: "
                                       "not Unicode text") from None
    return {
        "trace_id": trace_id,
        "record_id": record_id,
        "source": source.label if label is None else label,
        "location": location,
        # the record's own time; never the clock, so a rerun writes the same bytes
        "collected_at": collected_at,
        "messages": messages_text,
        "tools": tools_text,
        "outcome": parts.outcome,
        "score": parts.score,
        # every attempt at one scenario in one split, when the records say which (collect.group_by)
        "split": split_of(group or conversation_hash(messages), cfg.heldout_fraction),
        "group": group,
        "scenario": scenario,
        "expected_actions": "" if expected is None else _JSON_TEXT(expected),
        "metadata": metadata_text,
    }, messages, parts.missing + (("group",) if cfg.group_by and not group else ())


def _group(record: dict, path: str | None) -> str:
    """collect.group_by's value in the record, as text; "" when unset or absent (split by the conversation)."""
    if path is None:
        return ""
    value = get_path(record, path)
    return "" if value in (_MISSING, None, "") else str(value)


def unknown_actions(row: dict) -> list[str]:
    """The expected actions' tools that the trace neither lists nor calls (a label for another agent's tools?)."""
    if not row["expected_actions"]:
        return []
    known = {t["function"]["name"] for t in orjson.loads(row["tools"])}
    known |= {c["function"]["name"] for m in orjson.loads(row["messages"]) for c in m.get("tool_calls") or []}
    return sorted({a["name"] for a in orjson.loads(row["expected_actions"])} - known)


def _unchanged(value):
    return value


def _message_strings(messages: list[dict]) -> list[str]:
    """Every string of normalised messages that redaction could change (roles are one of ROLES, call types
    'function', and a result's tool_call_id is its call's id, as normalise_messages checked)."""
    out = []
    for message in messages:
        if message["content"]:
            out.append(message["content"])
        for call in message.get("tool_calls") or ():
            out += (call["id"], call["function"]["name"], call["function"]["arguments"])
    return out


# Every record of an agent carries the same few tool lists: their JSON text is kept, keyed by orjson's text of
# the list (~10x cheaper to make) and given back only for an equal list. The two checks together are exact:
# equal orjson texts differ in json's text only where orjson writes null for NaN or an infinity, and those
# lists are not equal (NaN equals nothing, None no number).
_TOOLS_TEXT: dict[bytes, tuple[list, str]] = {}


def _tools_text(tools: list) -> str:
    try:
        key = orjson.dumps(tools)
    except (TypeError, orjson.JSONEncodeError):  # integers past 64 bits, lone surrogates, ...: json decides
        return _JSON_TEXT(tools)
    kept = _TOOLS_TEXT.get(key)
    if kept is not None and kept[0] == tools:
        return kept[1]
    text = _JSON_TEXT(tools)
    if len(_TOOLS_TEXT) >= 1_000:
        _TOOLS_TEXT.clear()
    _TOOLS_TEXT[key] = (tools, text)
    return text


def redact_location(location: str, redactor: Redactor) -> str:
    """`file:line`, `s3://bucket/key:line`, `mlflow:...` with personal data in the name replaced.

    File names and object keys are often made of user ids and addresses (`exports/jane@example.com.jsonl`).
    The name is redacted apart from its line number, so a file's many records cost one search (the redactor
    remembers strings it has seen) and the line stays readable.
    """
    head, sep, tail = location.rpartition(":")
    if sep and tail.isdigit():
        return f"{redactor.text(head)}:{tail}"
    return redactor.text(location)

