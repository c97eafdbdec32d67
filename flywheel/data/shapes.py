"""Record shapes: OpenAI chat records, a proxy's request/response logs, or any format through a field mapping.

Also what a trace reader raises: BadRecord for one record, SourceError for a whole source.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime

from flywheel.config import OutcomeRule, SourceConfig
from flywheel.errors import UserFacingError


class BadRecord(ValueError):
    """A record that cannot become a trace: a short kind (counted) and a reason (kept with the record)."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind

    def __reduce__(self):  # pickled to and from collect's worker processes
        return type(self), (self.kind, str(self))


class SourceError(UserFacingError, RuntimeError):
    """A source cannot be read at all (no such bucket, no access, no such experiment); names the source."""


class PartialTurn(Exception):
    """A proxy log of a call that ended in tool calls, with no label: the next call's log holds the whole turn."""


@dataclass
class Parts:
    """What a record says, before the messages are checked and normalised."""

    messages: object
    tools: object
    outcome: str
    score: float | None
    record_id: str
    time: str
    metadata: dict
    scenario: str = ""  # the user's goal, "" when the record has none
    expected_actions: list[dict] | None = None  # [{name, arguments}], None when the record has none
    missing: tuple[str, ...] = ()  # fields the source names that this record lacks (counted by collect)
    partial: bool = False  # a proxy call that ended in tool calls, kept for its label: the messages end in them


_MISSING = object()
# ISO-8601 UTC to the second, the form timestamp() writes: read and written again, it comes out as it went in
_PLAIN_UTC = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z")
# Where each part is when the config does not say: candidates in order, the first present wins.
_DEFAULTS = {
    "chat": {"messages": ["messages"], "tools": ["tools"], "outcome": ["outcome"], "score": ["score"],
             "id": ["id"], "time": ["timestamp"], "scenario": ["scenario"], "expected_actions": ["expected_actions"]},
    "proxy": {"messages": ["request.messages"], "tools": ["request.tools"], "outcome": ["outcome"],
              "score": ["score"], "id": ["id", "response.id"], "time": ["timestamp", "response.created"],
              "scenario": ["scenario"], "expected_actions": ["expected_actions"]},
}
_DEFAULTS["mapped"] = _DEFAULTS["chat"]
# Parts a source may name that a record may lack: its task falls back (recorded user turns, recorded writes)
_OPTIONAL = ("scenario", "expected_actions")


def get_path(record, path: str):
    """The value at a dotted path (`request.messages`, `choices.0.message`), or _MISSING."""
    if "." not in path and isinstance(record, dict):  # a top-level field, as most are: one lookup
        return record.get(path, _MISSING)
    node = record
    for part in path.split("."):
        if isinstance(node, dict):
            node = node.get(part, _MISSING)
        elif isinstance(node, list) and part.lstrip("-").isdigit() and -len(node) <= int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
        if node is _MISSING:
            return _MISSING
    return node


def shape_of(record: dict, source: SourceConfig) -> str:
    """The shape the source names, else the one this record has."""
    if source.shape != "auto":
        return source.shape
    if source.fields.messages:
        return "mapped"
    if "messages" in record:
        return "chat"
    if isinstance(record.get("request"), dict) and "response" in record:
        return "proxy"
    raise BadRecord("unknown_shape", "neither chat (`messages`) nor a proxy log (`request`/`response`); "
                                     "name the fields in the source's `fields:` mapping")


def extract(record: dict, source: SourceConfig) -> Parts:
    """The parts of one record; raise BadRecord, or PartialTurn for a proxy call that ended in tool calls and
    carries no label (a labelled one is kept, `partial`, so that collect can join its label to the whole turn)."""
    shape = shape_of(record, source)
    where, consumed = _layout(source, shape)
    found = {name: _first(record, paths) for name, paths in where.items()}
    if isinstance(source.fields.id, list):  # several paths: their values joined, all of them or none
        values = [get_path(record, path) for path in source.fields.id]
        found["id"] = _MISSING if any(v in (_MISSING, None) for v in values) else ":".join(map(str, values))
    consumed = list(consumed)

    messages = _json_text(found["messages"], where["messages"][0])
    if messages is _MISSING:
        raise BadRecord("missing_field", f"no messages at '{where['messages'][0]}'")
    partial = False
    if shape == "proxy" and not source.fields.messages:
        if not isinstance(messages, list):
            raise BadRecord("wrong_type", "request.messages is not a list")
        reply = get_path(record, "response.choices.0.message")
        if not isinstance(reply, dict):
            raise BadRecord("no_response", "the response has no choices[0].message (a failed call?)")
        partial = bool(reply.get("tool_calls"))
        messages = [*messages, reply]
        consumed.append("response.choices")
    score = found["score"]
    if score is _MISSING or score is None:
        score = None
    elif isinstance(score, bool) or not isinstance(score, int | float):
        raise BadRecord("wrong_type", f"score at '{where['score'][0]}' is not a number ({score!r})")
    outcome = outcome_of(found["outcome"], score, source.outcome, where["outcome"][0])
    if partial and outcome == "unknown" and score is None:
        raise PartialTurn()  # no verdict to keep: the turn is in the call that completes it
    tools = _json_text(found["tools"], where["tools"][0])
    missing = tuple(name for name in _OPTIONAL if getattr(source.fields, name) and found[name] in (_MISSING, None))
    return Parts(messages=messages, tools=[] if tools is _MISSING or tools is None else tools,
                 outcome=outcome, score=float(score) if score is not None else None,
                 record_id="" if found["id"] in (_MISSING, None) else str(found["id"]),
                 time=timestamp(found["time"]), metadata=_without(record, consumed),
                 scenario=_scenario(found["scenario"], where["scenario"][0]),
                 expected_actions=expected_actions(found["expected_actions"], where["expected_actions"][0]),
                 missing=missing, partial=partial)


def _scenario(value, path: str) -> str:
    if value is _MISSING or value is None:
        return ""
    if not isinstance(value, str):
        raise BadRecord("wrong_type", f"the scenario at '{path}' is {type(value).__name__}, not text")
    return value.strip()


def expected_actions(value, path: str) -> list[dict] | None:
    """The record's expected actions as [{name, arguments}] (arguments a JSON object, or its JSON text); None
    when it has none; BadRecord when they are not that."""
    value = _json_text(value, path) if isinstance(value, str) else value
    if value is _MISSING or value is None:
        return None
    if not isinstance(value, list):
        raise BadRecord("bad_expected_actions", f"'{path}' is {type(value).__name__}, not a list of "
                                                "{name, arguments}")
    out = []
    for i, action in enumerate(value):
        name = action.get("name") if isinstance(action, dict) else None
        arguments = action.get("arguments", action.get("kwargs", {})) if isinstance(action, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(name, str) or not name or not isinstance(arguments, dict):
            raise BadRecord("bad_expected_actions", f"'{path}'[{i}] is not {{name, arguments}} with a tool name and "
                                                    f"arguments that are a JSON object: {str(action)[:200]}")
        out.append({"name": name, "arguments": arguments})
    return out


# (shape, the source's field names) -> where each part is, and the paths extract consumes
_LAYOUTS: dict[tuple, tuple[dict[str, list[str]], tuple[str, ...]]] = {}


def _layout(source: SourceConfig, shape: str) -> tuple[dict[str, list[str]], tuple[str, ...]]:
    fields = source.fields
    key = (shape, fields.messages, fields.tools, fields.outcome, fields.score, str(fields.id), fields.time,
           fields.scenario, fields.expected_actions)
    kept = _LAYOUTS.get(key)
    if kept is None:
        where = {name: ([given] if isinstance(given := getattr(fields, name), str) else default)
                 for name, default in _DEFAULTS[shape].items()}
        kept = where, tuple(paths[0] for name, paths in where.items() if name not in ("id", "time"))
        _LAYOUTS[key] = kept
    return kept


def outcome_of(value, score: float | None, rule: OutcomeRule, path: str) -> str:
    """accepted/rejected/unknown: the field's value when it has one, else the score against the threshold."""
    if value is _MISSING or value is None:
        if rule.score_threshold is not None and score is not None:
            return "accepted" if score >= rule.score_threshold else "rejected"
        return rule.missing if score is None else "unknown"
    for outcome, values in (("accepted", rule.accepted), ("rejected", rule.rejected), ("unknown", rule.unknown)):
        if any(_loosely_equal(value, v) for v in values):
            return outcome
    raise BadRecord("bad_outcome", f"{path} is {value!r}: not one of accepted {rule.accepted}, rejected "
                                   f"{rule.rejected}, unknown {rule.unknown} (the source's `outcome:` rule)")


def timestamp(value) -> str:
    """ISO-8601 UTC from epoch seconds or milliseconds or an ISO string; other text as it is; '' if none."""
    if value is _MISSING or value is None or value == "":
        return ""
    if isinstance(value, str) and _PLAIN_UTC.fullmatch(value):
        return value  # what the parse below gives back for it, whether it is a real time or not
    try:
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            moment = datetime.fromtimestamp(value / 1000 if value > 1e11 else value, UTC)
        elif isinstance(value, str):
            moment = datetime.fromisoformat(value.strip())
            moment = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
        else:
            return str(value)
    except (ValueError, OverflowError, OSError):
        return str(value)
    text = moment.isoformat(timespec="milliseconds" if moment.microsecond else "seconds")
    return text.removesuffix("+00:00") + "Z"


def _first(record, paths: list[str]):
    for path in paths:
        value = get_path(record, path)
        if value is not _MISSING:
            return value
    return _MISSING


def _json_text(value, path: str):
    # Tables (Parquet, our own traces table) keep messages and tools as JSON text.
    if isinstance(value, str):
        if not value.lstrip().startswith(("[", "{")):
            raise BadRecord("wrong_type", f"'{path}' is text, not a list")
        try:
            return json.loads(value)
        except json.JSONDecodeError as err:
            raise BadRecord("invalid_json", f"'{path}' is text but not JSON: {err.msg}") from None
    return value


def _loosely_equal(a, b) -> bool:
    """Equal, text regardless of case; a bool only to itself (True is not 1)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, str) and isinstance(b, str):
        return a.casefold() == b.casefold()
    return a == b


def _without(record: dict, paths: list[str]) -> dict:
    """A copy of the record without the values at these paths (dicts along a path copied, nothing else)."""
    out = dict(record)
    for path in paths:
        *parents, leaf = path.split(".")
        node = out
        for part in parents:
            child = node.get(part) if isinstance(node, dict) else None
            if not isinstance(child, dict):
                break
            node[part] = node = dict(child)
        else:
            if isinstance(node, dict):
                node.pop(leaf, None)
    return out
