"""Served traffic as traces: each answered request one JSON Lines record in the proxy-log shape collect reads.

A record is `{"id", "timestamp", "request": {...}, "response": {...}, "served": {model, version, alias}}`:
collect's `proxy` shape takes the conversation from `request.messages` plus the response's first choice, skips
an answer that ends in tool calls (the next request holds the whole turn), and keeps the rest of the record,
`served` included, as the trace's metadata. Point a pipeline's `collect.sources` at the folder.

Labels (`POST /v1/feedback`) are the same record again with `outcome`/`score`, written to `labels-*.jsonl`.
Collect keeps one row per conversation: the one that sorts first by (time, source, file, line). A label keeps
its answer's time, and `labels-` sorts before `traffic-`, so the labelled row replaces the unlabelled one even
when it arrives after a collect run; the first label of an answer is the one that counts.

A label may name an answer that ended in tool calls (an agent's client often holds the first id of its turn):
collect joins it to the conversation that completes the turn, the first later request whose messages extend
the labelled one (tracetable.join_labels), so the whole turn carries it, and `metadata.labelled_answer` names
the id labelled. Until such a request is recorded, the labelled answer is a trace of its own, ending in its tool
calls, with the label.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from datetime import UTC, datetime
from pathlib import Path

log = logging.getLogger("flywheel.serve")

OUTCOMES = ("accepted", "rejected", "unknown")
_REMEMBERED = 50_000  # answers kept in memory for labelling; older ones are found by reading the files
_ANSWER_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")  # a completion id this server made
_REQUEST_KEYS = ("model", "temperature", "top_p", "n", "max_tokens", "max_completion_tokens", "seed", "tool_choice")


class UnknownAnswer(KeyError):
    """Feedback for an id this server never answered (or whose files are gone)."""


def _now() -> datetime:
    return datetime.now(UTC)


def _stamp(moment: datetime) -> str:
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class TrafficLog:
    """Appends answered requests to `<folder>/traffic-YYYY-MM-DD.jsonl` and labels to `labels-YYYY-MM-DD.jsonl`."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._recent: OrderedDict[str, dict] = OrderedDict()
        self.recorded = 0
        self.labelled = 0

    def record(self, body: dict, response: dict, served: dict) -> dict:
        """Write one answered request: the request as sent (messages, tools, sampling), the response, and
        what served it."""
        moment = _now()
        request = served_request(body)
        record = {"id": response["id"], "timestamp": _stamp(moment), "request": request, "response": response,
                  "served": served}
        self._append(f"traffic-{moment:%Y-%m-%d}.jsonl", record)
        with self._lock:
            self.recorded += 1
            self._recent[record["id"]] = record
            while len(self._recent) > _REMEMBERED:
                self._recent.popitem(last=False)
        return record

    def label(self, answer_id: str, outcome: str | None = None, score: float | None = None) -> dict:
        """Record an operator's verdict on an answer (by its response id); UnknownAnswer if there is none."""
        record = self._find(answer_id)
        labelled = dict(record)
        if outcome is not None:
            labelled["outcome"] = outcome
        if score is not None:
            labelled["score"] = score
        labelled["labelled_at"] = _stamp(_now())
        self._append(f"labels-{_now():%Y-%m-%d}.jsonl", labelled)
        with self._lock:
            self.labelled += 1
        return labelled

    def _find(self, answer_id: str) -> dict:
        with self._lock:
            if answer_id in self._recent:
                return self._recent[answer_id]
        for path in sorted(self.folder.glob("traffic-*.jsonl"), reverse=True):  # newest day first
            with path.open(encoding="utf-8") as handle:
                for line in handle:
                    if answer_id in line:
                        record = json.loads(line)
                        if record.get("id") == answer_id:
                            return record
        raise UnknownAnswer(answer_id)

    def _append(self, name: str, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with self._lock, (self.folder / name).open("a", encoding="utf-8") as handle:
            handle.write(line)  # one write of a whole line: a reader never sees half a record as complete


def served_request(body: dict) -> dict:
    """What a record keeps of a request: its messages, tools and sampling settings."""
    request = {"messages": body["messages"], **{k: body[k] for k in _REQUEST_KEYS if k in body}}
    if body.get("tools"):
        request["tools"] = body["tools"]
    return request


class MlflowTraffic:
    """Answered requests as MLflow traces in one experiment (`serve-model --mlflow-traces`): a CHAT_MODEL span
    each, its client request id the completion's id. Feedback given on them in MLflow's UI (an assessment named
    `outcome` or `score`) comes back through a collect source `mlflow: EXPERIMENT` (docs/traces.md)."""

    def __init__(self, root: Path, pipeline: str, experiment: str):
        from flywheel import registry

        self.pipeline, self.experiment = pipeline, experiment
        self.experiment_id = registry.experiment_id(root, experiment)
        self.recorded = 0
        self.failed = 0

    def record(self, body: dict, response: dict, served: dict, latency_s: float) -> str | None:
        """Write one answered request as a trace; its id, or None when the store refused it (the answer stands)."""
        from flywheel import tracing

        trace = tracing.served_trace(served_request(body), response, served, latency_s, self.pipeline)
        try:
            [trace_id] = tracing.write([trace], self.experiment_id)
        except Exception as err:  # noqa: BLE001 -- a tracking store's errors vary; the client has its answer
            self.failed += 1
            log.error("answer %s: its MLflow trace was not written: %s: %s", response.get("id"),
                      type(err).__name__, err)
            return None
        self.recorded += 1
        return trace_id

    def label(self, answer_id: str, outcome: str | None = None, score: float | None = None) -> bool:
        """A `/v1/feedback` verdict as assessments `outcome` and `score` on the answer's trace (what a reviewer
        gives in MLflow's UI); False when no trace here has that completion id."""
        from mlflow.entities import AssessmentSource, Feedback
        from mlflow.tracing.client import TracingClient

        if not _ANSWER_ID.match(answer_id):  # it goes into a search filter
            return False
        client = TracingClient(os.environ.get("MLFLOW_TRACKING_URI"))
        found = client.search_traces(locations=[self.experiment_id], max_results=1, include_spans=False,
                                     filter_string=f"attributes.client_request_id = '{answer_id}'")
        if not found:
            return False
        source = AssessmentSource(source_type="HUMAN", source_id="serve-model /v1/feedback")
        for name, value in (("outcome", outcome), ("score", score)):
            if value is not None:
                client.log_assessment(found[0].info.trace_id, Feedback(name=name, value=value, source=source))
        return True
