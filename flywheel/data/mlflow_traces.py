"""MLflow Tracing as a trace source: an experiment's traces rebuilt into chat messages with tool calls.

The chat/LLM spans say what the model saw (their `messages` input) and said (their output); the TOOL spans
between two model calls hold the results of the calls the first one made. The conversation is the longest
history a model call saw, plus each later reply and the tool results that answered it.

The watermark is the request time of the newest trace read, less a look-back: a trace is written when it
finishes, so one that started earlier can appear after a later one; ids seen inside the look-back are skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from datetime import UTC, datetime

from flywheel.config import SourceConfig
from flywheel.data.shapes import BadRecord, SourceError
from flywheel.tags import TRACE_KIND_TAG

CHAT_SPANS = {"CHAT_MODEL", "LLM"}
# the project's own episodes (flywheel/tracing.py) in a pipeline's experiment: never traffic to learn from
EPISODE_KINDS = {"evaluate", "eval", "rl"}
LOOKBACK_MS = 3_600_000  # an agent run longer than an hour that finishes late is read in full re-collects only
_PAGE = 500


class MlflowReader:
    """The finished traces of one MLflow experiment (`mlflow: NAME` in the source)."""

    def __init__(self, source: SourceConfig, max_bytes: int):
        self.source, self.max_bytes = source, max_bytes
        self.state: dict = {}

    def _client(self):
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.source.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"))

    def _experiment(self, client) -> str:
        found = client.get_experiment_by_name(self.source.mlflow)
        if found is None:
            raise SourceError(f"source '{self.source.label}': no MLflow experiment named '{self.source.mlflow}' "
                              f"at {client.tracking_uri}")
        return found.experiment_id

    def _search(self, since_ms: int | None, include_spans: bool) -> Iterator:
        client = self._client()
        experiment = self._experiment(client)
        query = f"timestamp_ms >= {since_ms}" if since_ms is not None else None
        token = None
        while True:
            page = client.search_traces(locations=[experiment], filter_string=query, max_results=_PAGE,
                                        order_by=["timestamp_ms ASC"], page_token=token,
                                        include_spans=include_spans)
            yield from page
            token = page.token
            if not token:
                return

    def read(self, since: dict | None) -> Iterator[tuple[str, str | None, dict | BadRecord]]:
        since = since or {}
        start = since.get("timestamp_ms")
        seen = set(since.get("ids", []))
        newest, unfinished, read = start or 0, None, {}
        for trace in self._search(None if start is None else start - LOOKBACK_MS, include_spans=True):
            info = trace.info
            state = _state(info)
            if state not in ("OK", "ERROR"):  # still running: a later run reads it
                unfinished = min(unfinished or info.request_time, info.request_time)
                continue
            read[info.trace_id] = info.request_time
            newest = max(newest, info.request_time)
            if info.trace_id in seen or (info.tags or {}).get(TRACE_KIND_TAG) in EPISODE_KINDS:
                continue
            location = f"mlflow:{self.source.mlflow}/{info.trace_id}"
            try:
                record = trace_record(trace)
            except BadRecord as bad:
                yield location, json.dumps({"trace_id": info.trace_id}), bad
                continue
            yield location, None, record
        mark = newest if unfinished is None else min(newest, unfinished)
        keep = {t for t, ms in read.items() if ms >= mark - LOOKBACK_MS}
        self.state = {"timestamp_ms": mark, "ids": sorted(keep)}

    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        for trace in self._search(None, include_spans=False):
            digest.update(f"{trace.info.trace_id}:{_state(trace.info)};".encode())
        return digest.hexdigest()


def _state(info) -> str:
    return getattr(info.state, "value", str(info.state))


def trace_record(trace) -> dict:
    """A chat-shaped record from one trace: messages, tools, and the trace's tags and assessments."""
    spans = sorted(trace.data.spans, key=lambda s: s.start_time_ns)
    chats = [s for s in spans if s.span_type in CHAT_SPANS]
    if not chats:
        raise BadRecord("no_chat_span", "the trace has no CHAT_MODEL or LLM span to rebuild messages from")
    tool_spans = [s for s in spans if s.span_type == "TOOL"]
    messages: list[dict] = []
    tools = None
    for i, chat in enumerate(chats):
        seen = _input_messages(chat.inputs)
        if len(seen) >= len(messages):  # what the model saw is the history, where it has it all
            messages = list(seen)
        tools = tools or chat.get_attribute("mlflow.chat.tools") or _get(chat.inputs, "tools")
        reply = _output_message(chat.outputs)
        if reply is None:
            raise BadRecord("wrong_type", f"span '{chat.name}' has no assistant message in its outputs")
        messages.append(reply)
        calls = reply.get("tool_calls") or []
        end = chats[i + 1].start_time_ns if i + 1 < len(chats) else float("inf")
        window = [s for s in tool_spans if chat.start_time_ns < s.start_time_ns < end]
        for call in calls:
            span = _tool_span_for(call, window)
            if span is not None:
                window.remove(span)
                messages.append({"role": "tool", "tool_call_id": call.get("id"), "content": _text(span.outputs)})
    info = trace.info
    tags = {k: v for k, v in (info.tags or {}).items() if not k.startswith("mlflow.")}
    assessments = {a.name: _assessment_value(a) for a in info.assessments or [] if a.valid is not False}
    record = {"id": info.trace_id, "timestamp": datetime.fromtimestamp(info.request_time / 1000, UTC).isoformat(),
              "messages": messages, "tools": tools or [], "state": _state(info), "tags": tags,
              "assessments": assessments, "trace_name": (info.tags or {}).get("mlflow.traceName", "")}
    for part in ("outcome", "score"):  # the conventional names, from a tag or an assessment
        value = assessments.get(part, tags.get(part))
        if value is not None:
            record[part] = _number(value) if part == "score" else value
    return record


def _get(value, key: str):
    return value.get(key) if isinstance(value, dict) else None


def _input_messages(inputs) -> list[dict]:
    found = _get(inputs, "messages")
    if found is None and isinstance(inputs, list):
        found = inputs
    return [m for m in found if isinstance(m, dict)] if isinstance(found, list) else []


def _output_message(outputs) -> dict | None:
    """The assistant message of a model call's output: an OpenAI completion, a message, or plain text."""
    choice = _get(outputs, "choices")
    if isinstance(choice, list) and choice and isinstance(_get(choice[0], "message"), dict):
        return {"role": "assistant", **choice[0]["message"]}
    if isinstance(outputs, dict) and ("content" in outputs or "tool_calls" in outputs):
        return {"role": "assistant", **outputs}
    if isinstance(outputs, str):
        return {"role": "assistant", "content": outputs}
    return None


def _tool_span_for(call: dict, window: list):
    """The TOOL span that ran this call: the first one named like the function, else the first one left."""
    name = (call.get("function") or {}).get("name") if isinstance(call, dict) else None
    return next((s for s in window if s.name == name), window[0] if window else None)


def _text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def _assessment_value(assessment):
    part = assessment.feedback or assessment.expectation
    return getattr(part, "value", None)


def _number(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return value  # left as it is: the shape check says what is wrong with it
