"""The data contracts between stages, as pandera models checked when a table is written and when it is read."""

from __future__ import annotations

import pandera.pandas as pa
from pandera.typing import Series


class Strict(pa.DataFrameModel):
    class Config:
        strict = True  # an unexpected column is a contract break, not extra baggage
        coerce = True


class Traces(Strict):
    trace_id: Series[str] = pa.Field(unique=True)
    source: Series[str]
    location: Series[str]
    collected_at: Series[str]
    messages: Series[str]  # JSON text, OpenAI chat format
    tools: Series[str]  # JSON text, OpenAI function schemas
    outcome: Series[str] = pa.Field(isin=["accepted", "rejected", "unknown"])
    score: Series[float] = pa.Field(nullable=True)
    split: Series[str] = pa.Field(isin=["train", "heldout"])
    metadata: Series[str]


class Quarantine(Strict):
    source: Series[str]
    location: Series[str]
    kind: Series[str]
    reason: Series[str]
    raw: Series[str]


class Tasks(Strict):
    task_id: Series[str] = pa.Field(unique=True)
    env: Series[str]
    prompt: Series[str]  # JSON text: the prompt messages
    answer: Series[str]  # JSON text: what the rubric checks against
    slice: Series[str]
    split: Series[str] = pa.Field(isin=["train", "heldout"])
    origin: Series[str] = pa.Field(isin=["generated", "trace"])


class Synthetic(Strict):
    sample_id: Series[str] = pa.Field(unique=True)
    task_id: Series[str]
    teacher: Series[str]
    messages: Series[str]
    tools: Series[str]
    reward: Series[float] = pa.Field(ge=0, le=1)
    breakdown: Series[str]
    accepted: Series[bool]
    tokens_in: Series[int] = pa.Field(ge=0)
    tokens_out: Series[int] = pa.Field(ge=0)
    latency_s: Series[float] = pa.Field(ge=0)


class Rollouts(Strict):
    step: Series[int] = pa.Field(ge=0)
    policy_version: Series[int] = pa.Field(ge=0)
    behaviour_version: Series[int] = pa.Field(ge=0)
    task_id: Series[str]
    group: Series[int] = pa.Field(ge=0)
    sample: Series[int] = pa.Field(ge=0)
    reward: Series[float] = pa.Field(ge=0, le=1)
    advantage: Series[float] = pa.Field(nullable=True)
    tokens: Series[int] = pa.Field(ge=0)
    passed: Series[bool]


class Eval(Strict):
    model: Series[str]
    task_id: Series[str]
    sample: Series[int] = pa.Field(ge=0)
    reward: Series[float] = pa.Field(ge=0, le=1)
    passed: Series[bool]
    slice: Series[str]
