"""The `collect:` section: where traces come from, how a record's fields are found, what is redacted."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from flywheel.config.sections import Section

RedactionKind = Literal["email", "phone", "credit_card", "ip_address", "api_key", "token", "private_key"]
REDACTION_KINDS = ["email", "phone", "credit_card", "ip_address", "api_key", "token", "private_key"]


class FieldMapping(Section):
    """Where a record keeps each part: dotted paths into the record, list indexes allowed (`turns.0.text`)."""

    # None takes the shape's own place: `messages`, `tools`, `outcome`, `score`, `id`, `timestamp` (chat);
    # `request.messages` + the response's message, `request.tools`, ... `response.id`, `response.created` (proxy).
    messages: str | None = None
    tools: str | None = None
    outcome: str | None = None
    score: str | None = None
    # one path, or several whose values are joined with ":" ([task_id, trial]: a task id repeated per attempt)
    id: str | list[str] | None = None
    time: str | None = None
    # the user's goal, for a simulated user (environment.user: openai); default: a top-level `scenario`
    scenario: str | None = None
    # the label's own ground truth, a list of {name, arguments}: the writes replay requires instead of the
    # recorded ones; default: a top-level `expected_actions`
    expected_actions: str | None = None

    @model_validator(mode="after")
    def _some_id_path(self) -> FieldMapping:
        if isinstance(self.id, list) and not self.id:
            raise ValueError("fields.id is an empty list: name one path, or several to join")
        return self


class TurnLayout(Section):
    """How a record writes each message when it is not OpenAI chat (flywheel/data/turns.py): paths into a
    message, and into each of its calls."""

    role: str = "role"
    content: str = "content"
    roles: dict[str, str] = {}  # the log's role names -> system, user, assistant, tool ({AI: assistant})
    skip: list[str] = []  # roles (after renaming) whose messages are left out
    calls: str | None = "tool_calls"  # an assistant message's list of calls
    # Only the entries of `calls` holding this path are calls (a turn's list of frames, some with a call in them);
    # unset: every entry is a call.
    call_if: str | None = None
    call_name: str = "name"
    call_arguments: str = "arguments"  # an object, or its JSON text
    call_id: str | None = "id"  # null: ids are made up (call_<message>_<call>)
    # Each call holds its own result (ToolTalk): where; the call's error, when it has one, is the result instead.
    # Unset: results are tool messages, each naming its call at `result_id`.
    call_result: str | None = None
    call_error: str | None = None
    result_id: str = "tool_call_id"


class OutcomeRule(Section):
    """accepted/rejected/unknown from the outcome field's value (a flag is a true/false field), else the score."""

    accepted: list[str | bool | int] = ["accepted"]
    rejected: list[str | bool | int] = ["rejected"]
    unknown: list[str | bool | int] = ["unknown"]
    # When the outcome field is absent: score >= threshold is accepted, below it rejected; None: unknown.
    score_threshold: float | None = None
    # A record with neither an outcome nor a score (a benchmark's reference conversations: all accepted).
    missing: Literal["accepted", "rejected", "unknown"] = "unknown"


class SourceConfig(Section):
    """One place traces come from: exactly one of `path` (globs), `s3` (a prefix) or `mlflow` (an experiment)."""

    name: str | None = None  # the `source` column and the metric names; derived from the location if unset
    path: list[str] | None = None  # globs under the project root: .jsonl, .ndjson, .json (+ .gz), .parquet
    s3: str | None = None  # s3://bucket/prefix; endpoint, region and credentials from the AWS environment
    mlflow: str | None = None  # an experiment name; its traces are rebuilt into chat messages
    tracking_uri: str | None = None  # for `mlflow`; default MLFLOW_TRACKING_URI
    format: Literal["auto", "jsonl", "json", "parquet"] = "auto"  # auto: by file name
    shape: Literal["auto", "chat", "proxy", "mapped"] = "auto"  # auto: detected per record
    fields: FieldMapping = FieldMapping()
    # the messages' own layout, when they are not OpenAI chat messages (turns.py); null: they are
    turns: TurnLayout | None = None
    outcome: OutcomeRule = OutcomeRule()

    @model_validator(mode="before")
    @classmethod
    def _one_path_is_a_list(cls, data):
        if isinstance(data, dict) and isinstance(data.get("path"), str):
            data = {**data, "path": [data["path"]]}
        return data

    @model_validator(mode="after")
    def _one_location(self) -> SourceConfig:
        given = [k for k in ("path", "s3", "mlflow") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"a source needs exactly one of path, s3, mlflow (got {given or 'none'})")
        if self.s3 and not self.s3.startswith("s3://"):
            raise ValueError(f"s3 must look like s3://bucket/prefix (got {self.s3!r})")
        if self.shape == "mapped" and not self.fields.messages:
            raise ValueError("shape 'mapped' needs fields.messages: the path of the messages in a record")
        if self.name is not None and not re.fullmatch(r"[\w./: -]+", self.name):
            raise ValueError(f"name {self.name!r}: use letters, digits and _ . / : - (it names metrics)")
        return self

    @property
    def label(self) -> str:
        """The name, or one derived from the location that is safe in a metric name."""
        if self.name:
            return self.name
        if self.path:
            where = ",".join(re.split(r"[*?\[]", p)[0].rstrip("/") or p for p in self.path)
        else:
            where = self.s3.removeprefix("s3://").rstrip("/") if self.s3 else f"mlflow:{self.mlflow}"
        return re.sub(r"[^\w./:-]", "_", where)


class RedactionConfig(Section):
    """What is replaced by a typed placeholder (`<EMAIL>`) before anything is written."""

    kinds: list[RedactionKind] = list(REDACTION_KINDS)
    patterns: dict[str, str] = {}  # name -> regex; matches become <NAME>

    @model_validator(mode="after")
    def _patterns_compile(self) -> RedactionConfig:
        for name, pattern in self.patterns.items():
            if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
                raise ValueError(f"pattern name {name!r}: use lower_case letters, digits and _")
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"pattern {name!r} is not a valid regex: {err}") from None
        return self


class CollectConfig(Section):
    # A string is a glob under the project root, `s3://bucket/prefix`, or `mlflow:EXPERIMENT`. None: the tasks are
    # the environment's own.
    sources: list[SourceConfig] = []
    heldout_fraction: float = Field(0.1, gt=0, lt=1)
    # A record's field path (e.g. the logs' task id): every conversation of one group lands in the same split,
    # so other attempts at a held-out scenario never train; unset: each conversation is split by its opening.
    group_by: str | None = None
    max_bad_fraction: float = Field(0.2, ge=0, le=1)
    max_record_bytes: int = Field(1_000_000, ge=1024)  # a larger record is quarantined as oversize
    # Read only what is new since the last run (a watermark per source); false: re-read everything each run.
    incremental: bool = True
    redact: RedactionConfig = RedactionConfig()
    # Processes the records are checked, redacted and made tasks in (0: one per CPU core, at most 8; 1: this
    # process only). Only speed depends on it: the tables are the same bytes with any number.
    workers: int = Field(0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _source_strings(cls, data):
        if isinstance(data, dict) and isinstance(data.get("sources"), list):
            data = {**data, "sources": [_source_from_string(s) if isinstance(s, str) else s
                                        for s in data["sources"]]}
        return data

    @model_validator(mode="after")
    def _unique_names(self) -> CollectConfig:
        labels = [s.label for s in self.sources]
        twice = sorted({x for x in labels if labels.count(x) > 1})
        if twice:
            raise ValueError(f"sources named {twice} more than once: give each source its own `name`")
        return self


def _source_from_string(text: str) -> dict:
    if text.startswith("s3://"):
        return {"s3": text}
    if text.startswith("mlflow:"):
        return {"mlflow": text.removeprefix("mlflow:")}
    return {"path": [text]}
