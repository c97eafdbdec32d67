"""The data contracts between stages, as pandera models checked when a table is written and when it is read."""

from __future__ import annotations

import pandas as pd
import pandera.pandas as pa
from pandera.typing import Series


class Strict(pa.DataFrameModel):
    class Config:
        strict = True  # an unexpected column is a contract break, not extra baggage
        coerce = True


class Traces(Strict):
    trace_id: Series[str] = pa.Field(unique=True, str_matches=r"^[0-9a-f]{16}$")  # hash of messages + tools
    record_id: Series[str]  # the source's own id of the record, if it has one
    source: Series[str]  # the source's name in pipelines.yaml
    location: Series[str]  # file:line, s3://bucket/key:line, mlflow:experiment/trace id
    collected_at: Series[str]  # the record's own time, ISO-8601 UTC where it could be read
    messages: Series[str] = pa.Field(str_startswith="[")  # JSON text, OpenAI chat format
    tools: Series[str] = pa.Field(str_startswith="[")  # JSON text, OpenAI function schemas
    outcome: Series[str] = pa.Field(isin=["accepted", "rejected", "unknown"])
    score: Series[float] = pa.Field(nullable=True)
    split: Series[str] = pa.Field(isin=["train", "heldout"])  # by the group when it has one, else the opening
    group: Series[str]  # collect.group_by's value (the scenario an attempt is at); "" none
    scenario: Series[str]  # the user's goal (fields.scenario), for a simulated user; "" none
    expected_actions: Series[str]  # JSON text [{name, arguments}] (fields.expected_actions); "" none
    metadata: Series[str] = pa.Field(str_startswith="{")  # JSON text: the rest of the record

    @pa.check("score", name="finite")
    @classmethod
    def _finite(cls, score: Series[float]) -> Series[bool]:
        return score.isna() | score.abs().lt(float("inf"))


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
    group: Series[str]  # the scenario (collect.group_by) of a task from a trace; "" none
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
    dropped: Series[bool]  # consumed past max_staleness: counted, never trained on
    split: Series[bool]  # trained as per-turn segments: the template re-tokenised the episode differently

    @pa.dataframe_check
    def behaviour_not_newer(cls, df: pd.DataFrame) -> Series[bool]:
        """policy_version - behaviour_version is the staleness: never negative."""
        return df["behaviour_version"] <= df["policy_version"]


class Eval(Strict):
    model: Series[str]
    task_id: Series[str]
    sample: Series[int] = pa.Field(ge=0)
    reward: Series[float] = pa.Field(ge=0, le=1)
    passed: Series[bool]
    slice: Series[str]
    tokens: Series[int] = pa.Field(ge=0)  # generated tokens over the episode: the cost the gate can limit
    latency_s: Series[float] = pa.Field(ge=0)  # generation wall time over the episode
    cost_usd: Series[float] = pa.Field(ge=0)  # at the policy's token prices (0: unpriced)
    messages: Series[str] = pa.Field(str_startswith="[")  # JSON text: the whole conversation, OpenAI chat format
