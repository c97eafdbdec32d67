"""Episodes and served requests as MLflow traces: a span per model turn, tool call and user turn, the rubric's
verdict as assessments; written in batches through the tracking store, linked to a run.

A trace of an episode (evaluate's held-out episodes, a sample of RL's rollouts) is one AGENT span, the episode,
over a span per message after the prompt, in the conversation's order:

- a model turn: a CHAT_MODEL span, its inputs `{"messages": the conversation so far}` and its output the turn in
  OpenAI's completion shape, with its token counts (`mlflow.chat.tokenUsage`) and the tool schemas;
- a tool call: a TOOL span named after the function, its arguments in and its result out; a result that is the
  harness's `Error: ...` text (bad arguments, a timeout, a tool that raised) marks the span ERROR;
- the simulated user's turn: a USER span; the harness's own word after a malformed turn: a PARSER span.

The rubric's reward, pass and parts are Feedback assessments (source CODE, `rubric:<environment>`): MLflow's UI
shows them beside the conversation, and `mlflow.search_traces` filters on them. The traces are built when the
episodes end and written together at the end of the stage (`write`), so a stage pays a few store calls per
hundred episodes, not one per span. A served request (`flywheel serve-model --mlflow-traces`) is one CHAT_MODEL
span under its trace, its client request id the completion's id, so feedback given in MLflow's UI comes back
through collect's MLflow source (flywheel/data/mlflow_traces.py) as the trace's outcome or score.

MLflow's fluent tracing (`mlflow.start_span`) is not used: it exports through a process-wide tracer bound to the
tracking URI it first saw, asynchronously; these traces name their store and are written when `write` returns.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from flywheel.agent import Episode
from flywheel.contract import Environment
from flywheel.policies.base import Completion
from flywheel.registry import Run
from flywheel.tags import (
    PIPELINE_TAG,
    STAGE_TAG,
    TRACE_KIND_TAG,
    TRACE_MODEL_TAG,
    TRACE_SAMPLE_TAG,
    TRACE_SLICE_TAG,
    TRACE_SPLIT_TAG,
    TRACE_STOP_TAG,
    TRACE_TASK_TAG,
    TRACES_ERROR_TAG,
)

log = logging.getLogger(__name__)

USER_SPAN = "USER"  # the simulated user's turn (MLflow has no type for it; any name is allowed)
_BATCH = 100  # traces per log_spans call
_PREVIEW = 1000  # characters of the request and response previews


@dataclass(frozen=True)
class SpanSpec:
    """One span of a trace before it is written: what it is, what went in and out, how long it took."""

    name: str
    span_type: str
    inputs: Any
    outputs: Any
    duration_s: float = 0.0
    attributes: dict = field(default_factory=dict)
    error: str = ""  # the span ended in an error: this is why


@dataclass
class PendingTrace:
    """A trace to write: its root span's name, inputs and outputs, its child spans in order, tags and feedback."""

    name: str
    inputs: Any
    outputs: Any
    spans: list[SpanSpec]
    tags: dict[str, str]
    feedback: list[tuple[str, Any, str]] = field(default_factory=list)  # (name, value, rationale)
    source: str = "rubric"  # who gave the feedback (AssessmentSource id)
    client_request_id: str | None = None
    root_type: str = "AGENT"


def episode_trace(episode: Episode, *, model: str, tools: list[dict], kind: str, pipeline: str, rubric: str,
                  split: str = "heldout") -> PendingTrace:
    """An episode as a trace: tagged with the model's label, the task, its slice and split; the rubric's verdict
    (reward, passed, each part of the breakdown) as feedback from `rubric:<rubric>`."""
    task = episode.task
    prompt = len(task.prompt)
    answer = next((m for m in reversed(episode.messages) if m.get("role") == "assistant"), {})
    tags = {TRACE_KIND_TAG: kind, PIPELINE_TAG: pipeline, STAGE_TAG: kind, TRACE_MODEL_TAG: model,
            TRACE_TASK_TAG: task.task_id, TRACE_SLICE_TAG: task.slice, TRACE_SPLIT_TAG: split,
            TRACE_SAMPLE_TAG: str(episode.sample), TRACE_STOP_TAG: episode.stop}
    verdict = f"{'passed' if episode.passed else 'failed'}; the episode ended: {episode.stop}"
    feedback = [("reward", float(episode.reward), verdict), ("passed", bool(episode.passed), verdict)]
    feedback += [(f"rubric.{part}", float(value), "") for part, value in sorted(episode.breakdown.items())]
    return PendingTrace(name=f"{model}/{task.task_id}", inputs={"messages": task.prompt},
                        outputs={"answer": answer.get("content") or "", "stop": episode.stop,
                                 "turns": episode.turns},
                        spans=conversation_spans(episode.messages, prompt, episode.completions, tools),
                        tags=tags, feedback=feedback, source=f"rubric:{rubric}")


def log_episodes(entries: Sequence[tuple[str, Episode, dict]], run: Run, pipeline: str, env: Environment,
                 kind: str, split: str) -> int:
    """Write a trace of each (model label, episode, extra tags) to the run's experiment, linked to the run; how
    many were written (also the run's metric `traces`).

    Traces say how episodes went; they decide nothing. A store that refuses them is a warning and the run's tag
    `flywheel.traces_error`, never a failed stage."""
    if not entries:
        return 0
    tools = env.tools()
    pending = []
    for label, episode, extra in entries:
        trace = episode_trace(episode, model=label, tools=tools, kind=kind, pipeline=pipeline, rubric=env.name,
                              split=split)
        trace.tags.update({key: str(value) for key, value in extra.items()})
        pending.append(trace)
    try:
        written = write(pending, run_id=run.run_id)
    except Exception as err:  # noqa: BLE001 -- a tracking store's errors vary; the stage's numbers stand
        log.warning("the %s run %s: its episodes' traces were not written: %s: %s", kind, run.run_id,
                    type(err).__name__, err)
        run.tags({TRACES_ERROR_TAG: f"{type(err).__name__}: {err}"[:5000]})
        return 0
    run.metrics({"traces": len(written)})
    return len(written)


def spread(items: Sequence, cap: int) -> list:
    """At most `cap` of the items, evenly spaced from the first (RL's kept episodes over the steps)."""
    if cap <= 0 or not items:
        return []
    stride = -(-len(items) // cap)
    return list(items[::stride])[:cap]


def lean(episode: Episode) -> Episode:
    """The episode without its token ids and log-probabilities (what a trace needs, small to send between
    processes): each turn keeps its message, error, usage (generated tokens counted) and latency."""
    turns = [Completion(message=c.message, error=c.error, latency_s=c.latency_s,
                        usage={**c.usage, "completion_tokens": len(c.token_ids) if c.token_ids is not None
                               else int(c.usage.get("completion_tokens", 0))})
             for c in episode.completions]
    return Episode(task=episode.task, sample=episode.sample, messages=episode.messages, reward=episode.reward,
                   passed=episode.passed, breakdown=episode.breakdown, turns=episode.turns, stop=episode.stop,
                   completions=turns)


def conversation_spans(messages: list[dict], start: int, completions: Sequence, tools: list[dict]) -> list[SpanSpec]:
    """A span per message from `start` on: model turns (the i-th assistant message is the i-th completion), tool
    calls (matched to their call by id), user turns and the harness's word after a malformed turn."""
    spans: list[SpanSpec] = []
    turn = 0
    calls: dict[str, dict] = {}
    malformed = False
    for k in range(start, len(messages)):
        message = messages[k]
        role = message.get("role")
        if role == "assistant":
            completion = completions[turn] if turn < len(completions) else None
            turn += 1
            calls = {c.get("id"): c for c in message.get("tool_calls") or []}
            malformed = bool(completion is not None and completion.error)
            spans.append(_model_span(turn, messages[:k], message, completion, tools))
        elif role == "tool":
            call = calls.get(message.get("tool_call_id"), {})
            function = call.get("function") or {}
            content = str(message.get("content") or "")
            spans.append(SpanSpec(function.get("name") or "tool", "TOOL", _arguments(function.get("arguments")),
                                  content, attributes={"tool_call_id": message.get("tool_call_id") or ""},
                                  error=content if content.startswith("Error:") else ""))
        elif malformed:  # the harness's own message: the turn could not be read
            malformed = False
            spans.append(SpanSpec("harness: malformed turn", "PARSER", None, message.get("content"),
                                  error=str(message.get("content") or "")))
        else:
            spans.append(SpanSpec(role or "user", USER_SPAN, {"messages": messages[:k]}, message))
    return spans


def _model_span(turn: int, history: list[dict], message: dict, completion, tools: list[dict]) -> SpanSpec:
    usage = dict(completion.usage) if completion is not None else {}
    generated = (len(completion.token_ids) if completion is not None and completion.token_ids is not None
                 else int(usage.get("completion_tokens", 0)))
    prompt_tokens = int(usage.get("prompt_tokens", 0))
    reason = "tool_calls" if message.get("tool_calls") else "stop"
    output = {"object": "chat.completion", "choices": [{"index": 0, "message": message, "finish_reason": reason}],
              "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                        "total_tokens": prompt_tokens + generated}}
    attributes = {"mlflow.chat.tokenUsage": {"input_tokens": prompt_tokens, "output_tokens": generated,
                                             "total_tokens": prompt_tokens + generated},
                  "mlflow.message.format": "openai"}
    if tools:
        attributes["mlflow.chat.tools"] = tools
    error = completion.error if completion is not None and completion.error else ""
    return SpanSpec(f"model turn {turn}", "CHAT_MODEL", {"messages": history}, output,
                    completion.latency_s if completion is not None else 0.0, attributes, error or "")


def _arguments(raw) -> Any:
    """A tool call's arguments as the model wrote them: parsed when they are JSON, else the text."""
    if not isinstance(raw, str):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def served_trace(request: dict, response: dict, served: dict, latency_s: float, pipeline: str) -> PendingTrace:
    """A served request as a trace: one CHAT_MODEL span; its client request id is the completion's id."""
    usage = response.get("usage") or {}
    attributes = {"mlflow.chat.tokenUsage": {"input_tokens": int(usage.get("prompt_tokens", 0)),
                                             "output_tokens": int(usage.get("completion_tokens", 0)),
                                             "total_tokens": int(usage.get("total_tokens", 0))},
                  "mlflow.message.format": "openai"}
    if request.get("tools"):
        attributes["mlflow.chat.tools"] = request["tools"]
    inputs = {k: v for k, v in request.items() if k != "stream"}
    span = SpanSpec("chat.completions", "CHAT_MODEL", inputs, response, latency_s, attributes)
    tags = {TRACE_KIND_TAG: "served", PIPELINE_TAG: pipeline, TRACE_MODEL_TAG: f"v{served.get('version')}",
            "flywheel.alias": str(served.get("alias", ""))}
    return PendingTrace(name=f"{served.get('model', pipeline)}@{served.get('alias', '')}", inputs=inputs,
                        outputs=response, spans=[span], tags=tags, client_request_id=response.get("id"),
                        root_type="CHAIN")


def write(traces: Sequence[PendingTrace], experiment_id: str | None = None, run_id: str | None = None) -> list[str]:
    """Write the traces to the experiment (default: the run's), linked to `run_id` (`mlflow.search_traces(run_id=
    ...)` finds them); their ids, in order. The spans of up to a hundred traces go in one call."""
    from mlflow.tracing.client import TracingClient

    client = TracingClient(os.environ.get("MLFLOW_TRACKING_URI"))
    if experiment_id is None:
        experiment_id = client.store.get_run(run_id).info.experiment_id
    ids: list[str] = []
    for start in range(0, len(traces), _BATCH):
        ids += _write_batch(client, traces[start:start + _BATCH], experiment_id, run_id)
    return ids


def _write_batch(client, traces: Sequence[PendingTrace], experiment_id: str, run_id: str | None) -> list[str]:
    from mlflow.entities import TraceData
    from mlflow.tracing.constant import SpansLocation, TraceTagKey

    built = [_build(trace, experiment_id, run_id) for trace in traces]
    try:
        client.log_spans(experiment_id, [span for _, spans in built for span in spans])
    except NotImplementedError:  # a store that keeps spans as artifacts only: uploaded with each trace below
        pass
    ids = []
    for info, spans in built:
        stored = client.start_trace(info)
        if stored.tags.get(TraceTagKey.SPANS_LOCATION) != SpansLocation.TRACKING_STORE.value:
            client._upload_trace_data(stored, TraceData(spans=spans))  # what MLflow's own exporter does then
        if info.assessments and not stored.assessments:  # a store that took the info without them
            for assessment in info.assessments:
                client.log_assessment(stored.trace_id, assessment)
        ids.append(stored.trace_id)
    return ids


def _build(trace: PendingTrace, experiment_id: str, run_id: str | None):
    """The trace's TraceInfo (tags, run link, feedback) and its Span entities, laid end to end from now."""
    from mlflow.entities import AssessmentSource, Feedback, Span, TraceInfo, TraceLocation, TraceState
    from mlflow.tracing.constant import TRACE_SCHEMA_VERSION, TRACE_SCHEMA_VERSION_KEY, TraceMetadataKey

    otel_trace = random.getrandbits(128) or 1
    trace_id = f"tr-{otel_trace:032x}"
    root_id = random.getrandbits(64) or 1
    start = time.time_ns()
    cursor = start
    spans = []
    for spec in trace.spans:
        duration = max(int(spec.duration_s * 1e9), 1_000)  # in order even when nothing was timed
        spans.append(_span(trace_id, otel_trace, random.getrandbits(64) or 2, root_id, spec, cursor,
                           cursor + duration))
        cursor += duration
    errors = [s.name for s in trace.spans if s.error]
    root = SpanSpec(trace.name, trace.root_type, trace.inputs, trace.outputs,
                    attributes={"flywheel.errors": errors} if errors else {})
    spans.insert(0, _span(trace_id, otel_trace, root_id, None, root, start, max(cursor, start + 1_000)))
    metadata = {TRACE_SCHEMA_VERSION_KEY: str(TRACE_SCHEMA_VERSION),
                TraceMetadataKey.INPUTS: _preview(trace.inputs), TraceMetadataKey.OUTPUTS: _preview(trace.outputs)}
    if run_id:
        metadata[TraceMetadataKey.SOURCE_RUN] = run_id
    source = AssessmentSource(source_type="CODE", source_id=trace.source)
    feedback = [Feedback(name=name, value=value, source=source, trace_id=trace_id, rationale=rationale or None,
                         create_time_ms=start // 1_000_000, last_update_time_ms=start // 1_000_000)
                for name, value, rationale in trace.feedback]
    info = TraceInfo(trace_id=trace_id, trace_location=TraceLocation.from_experiment_id(experiment_id),
                     request_time=start // 1_000_000, execution_duration=max(cursor - start, 0) // 1_000_000,
                     state=TraceState.OK, request_preview=_preview(trace.inputs),
                     response_preview=_preview(trace.outputs), client_request_id=trace.client_request_id,
                     trace_metadata=metadata, tags={"mlflow.traceName": trace.name, **trace.tags},
                     assessments=feedback)
    return info, [Span.from_dict(s) for s in spans]


def _span(trace_id: str, otel_trace: int, span_id: int, parent: int | None, spec: SpanSpec, start: int,
          end: int) -> dict:
    """A span in MLflow's stored form (Span.from_dict): attributes are JSON text."""
    import base64

    def encode(value: int, size: int) -> str:
        return base64.b64encode(value.to_bytes(size, "big")).decode()

    attributes = {"mlflow.traceRequestId": trace_id, "mlflow.spanType": spec.span_type,
                  "mlflow.spanInputs": spec.inputs, "mlflow.spanOutputs": spec.outputs, **spec.attributes}
    if spec.error:
        attributes["flywheel.error"] = spec.error
    return {"trace_id": encode(otel_trace, 16), "span_id": encode(span_id, 8),
            "parent_span_id": encode(parent, 8) if parent is not None else None, "name": spec.name,
            "start_time_unix_nano": start, "end_time_unix_nano": end, "events": [],
            "status": {"code": "STATUS_CODE_ERROR" if spec.error else "STATUS_CODE_OK", "message": spec.error},
            "attributes": {k: json.dumps(v, ensure_ascii=False, default=str) for k, v in attributes.items()}}


def _preview(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text[:_PREVIEW]
