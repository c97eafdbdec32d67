"""Production traces from JSONL files in the OpenAI chat format: parsed, checked, normalised or quarantined."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from flywheel.envs.base import prompt_hash, split_of

ROLES = {"system", "user", "assistant", "tool"}
OUTCOMES = {"accepted", "rejected", "unknown"}


class BadRecord(ValueError):
    """A record that cannot become a trace: a short kind (counted) and a reason (kept with the record)."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind


@dataclass
class Collected:
    traces: list[dict]
    quarantine: list[dict]
    duplicates: int = 0


def read_jsonl(path: Path, root: Path) -> Iterator[tuple[str, str, dict | BadRecord]]:
    """(location, raw line, record or the reason it is not one) for every non-empty line of a JSONL file."""
    name = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
    with path.open("rb") as handle:
        for number, raw_bytes in enumerate(handle, start=1):
            location = f"{name}:{number}"
            try:
                raw = raw_bytes.decode("utf-8")
            except UnicodeDecodeError:
                yield location, raw_bytes.decode("utf-8", "replace"), BadRecord("not_utf8", "not UTF-8")
                continue
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as err:
                yield location, raw, BadRecord("invalid_json", f"invalid JSON: {err.msg}")
                continue
            if not isinstance(record, dict):
                yield location, raw, BadRecord("wrong_type", "record is not a JSON object")
                continue
            yield location, raw, record


def check_messages(messages) -> list[dict]:
    """Validate a conversation: known roles, every tool call answered by id and every tool result called."""
    if not isinstance(messages, list):
        raise BadRecord("wrong_type", "messages is not a list")
    if not messages:
        raise BadRecord("empty", "empty conversation")
    pending: dict[str, str] = {}
    seen_calls: set[str] = set()
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRecord("wrong_type", f"message {i} is not an object")
        role = message.get("role")
        if role not in ROLES:
            raise BadRecord("unknown_role", f"message {i} has unknown role {role!r}")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise BadRecord("wrong_type", f"message {i} content is not text")
        if role == "assistant":
            for call in message.get("tool_calls") or []:
                if not isinstance(call, dict) or "id" not in call or "name" not in call.get("function", {}):
                    raise BadRecord("bad_tool_call", f"message {i} has a tool call without id or function name")
                pending[call["id"]] = call["function"]["name"]
                seen_calls.add(call["id"])
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in seen_calls:
                raise BadRecord("orphan_tool_result", f"message {i} is a tool result without a matching call ({call_id!r})")
            pending.pop(call_id, None)
        elif pending:
            raise BadRecord("unanswered_tool_call", f"tool call {next(iter(pending))!r} has no result before message {i}")
    if pending:
        raise BadRecord("unanswered_tool_call", f"tool call {next(iter(pending))!r} has no result")
    if not any(m["role"] == "user" for m in messages):
        raise BadRecord("no_user_message", "conversation has no user message")
    return messages


def to_trace(record: dict, source: str, location: str, heldout_fraction: float) -> dict:
    """One traces-table row from a chat-format record; raise BadRecord with the reason otherwise."""
    messages = check_messages(record.get("messages"))
    tools = record.get("tools") or []
    if not isinstance(tools, list):
        raise BadRecord("wrong_type", "tools is not a list")
    outcome = record.get("outcome", "unknown")
    if outcome not in OUTCOMES:
        raise BadRecord("bad_outcome", f"outcome {outcome!r} is not one of {sorted(OUTCOMES)}")
    score = record.get("score")
    if score is not None and not isinstance(score, int | float):
        raise BadRecord("wrong_type", "score is not a number")
    body = json.dumps({"messages": messages, "tools": tools}, sort_keys=True, ensure_ascii=False)
    prompt = messages[: next(i for i, m in enumerate(messages) if m["role"] == "user") + 1]
    metadata = {k: v for k, v in record.items() if k not in {"messages", "tools", "outcome", "score"}}
    return {
        "trace_id": hashlib.sha256(body.encode()).hexdigest()[:16],
        "source": source,
        "location": location,
        # the record's own time; never the clock, so a rerun writes the same bytes
        "collected_at": str(record.get("timestamp") or ""),
        "messages": json.dumps(messages, ensure_ascii=False),
        "tools": json.dumps(tools, ensure_ascii=False),
        "outcome": outcome,
        "score": float(score) if score is not None else None,
        "split": split_of(prompt_hash(prompt), heldout_fraction),
        "metadata": json.dumps(metadata, sort_keys=True, default=str),
    }


def collect_files(paths: list[Path], root: Path, heldout_fraction: float) -> Collected:
    """Every record of every file: valid ones normalised and de-duplicated, the rest quarantined with reasons."""
    out = Collected([], [])
    seen: set[str] = set()
    for path in paths:
        source = f"file:{path.relative_to(root) if path.is_relative_to(root) else path}"
        for location, raw, record in read_jsonl(path, root):
            try:
                if isinstance(record, BadRecord):
                    raise record
                trace = to_trace(record, source, location, heldout_fraction)
            except BadRecord as bad:
                out.quarantine.append({"source": source, "location": location, "kind": bad.kind,
                                       "reason": str(bad), "raw": raw[:10_000]})
                continue
            if trace["trace_id"] in seen:
                out.duplicates += 1
            else:
                seen.add(trace["trace_id"])
                out.traces.append(trace)
    return out
