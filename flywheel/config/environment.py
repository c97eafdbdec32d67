"""The `environment:` section: which environment, its tasks and episode limits, its simulated user, replay's
rubric options."""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from flywheel.config.sections import Concurrency, EndpointConfig, MaxRetries, Section, TimeoutS


class ReplayJudgeConfig(EndpointConfig):
    """An LLM judge comparing the model's final answer with the accepted one (flywheel/envs/judge.py)."""

    where: ClassVar[str] = "environment.replay.judge"
    model: str  # the served model name
    concurrency: Concurrency = 4
    timeout_s: TimeoutS = 60.0
    weight: float = Field(0.2, gt=0)
    cache: str | None = ".flywheel/judge-cache.sqlite"  # under the project root; null: none


class ReplayConfig(Section):
    """How recorded traces become tasks: tools served from the record, a rubric from the accepted outcome."""

    # Which tools change state (flywheel/envs/replay/writes.py): `writes` and `reads` name tools; a tool the
    # logs' expected actions name is a write; `read_pattern` (case-insensitive regex, matched at the start) marks
    # look-ups, which never count; with neither list nor expected actions, every other tool is a write.
    writes: list[str] = []
    reads: list[str] = ["think", "calculate", "calculator"]
    read_pattern: str = "get|list|search|find|lookup|look_up|read|query|fetch|show|view"
    # How a write's argument is compared, by `tool.argument` or `argument`: exact, normalised (case, spacing,
    # number formats), judge (the model of `judge` below says whether the two say the same) or ignore.
    # Unnamed: normalised; free text (five words or more) takes `free_text`.
    arguments: dict[str, Literal["exact", "normalised", "judge", "ignore"]] = {}
    free_text: Literal["exact", "normalised", "judge", "ignore"] = "ignore"
    # Serving a model's call from the record: free text (two words or more) matches a recorded call's when the
    # word overlap (Jaccard) reaches this; 1.0: normalised text must be equal. Ids always match exactly.
    fuzzy: float = Field(0.8, gt=0, le=1)
    writes_weight: float = Field(0.5, ge=0)
    facts_weight: float = Field(0.5, ge=0)
    judge: ReplayJudgeConfig | None = None  # none: the rubric is deterministic
    # Rejected traces are never targets; "eval": each becomes a held-out task whose rubric is inverted (1 when
    # the model does not repeat what was rejected), in its own slice.
    rejected: Literal["drop", "eval"] = "drop"

    @model_validator(mode="before")
    @classmethod
    def _reads_pattern(cls, data):
        # `reads` was once the pattern alone: a string is still taken as one
        if isinstance(data, dict) and isinstance(data.get("reads"), str):
            data = {**data, "read_pattern": data["reads"], "reads": ["think", "calculate", "calculator"]}
        return data

    @model_validator(mode="after")
    def _usable(self) -> ReplayConfig:
        try:
            re.compile(self.read_pattern)
        except re.error as err:
            raise ValueError(f"read_pattern {self.read_pattern!r} is not a valid regex: {err}") from None
        judged = sorted(k for k, rule in self.arguments.items() if rule == "judge") + \
            (["free_text"] if self.free_text == "judge" else [])
        if judged and self.judge is None:
            raise ValueError(f"{judged}: the `judge` rule needs replay.judge (the model that compares the values)")
        both = sorted(set(self.writes) & set(self.reads))
        if both:
            raise ValueError(f"{both} named in both writes and reads: a tool is one or the other")
        if self.writes_weight + self.facts_weight + (self.judge.weight if self.judge else 0) <= 0:
            raise ValueError("the replay rubric needs a positive total weight (writes_weight, facts_weight, judge)")
        return self


class UserConfig(EndpointConfig):
    """Who plays the user after each of the agent's answers (flywheel/envs/users.py).

    replay: the recorded user turns, in order, one after each answer; when they run out the conversation ends.
    openai: an LLM plays the user over the OpenAI protocol from a scenario (the record's `fields.scenario`, else
    one this model writes once per trace from the recorded conversation, cached and stored with the task). It
    sees the scenario and the visible conversation only: never tool results, the agent's state or the rubric.
    none: the conversation ends at the agent's first answer (a single-turn task).
    """

    where: ClassVar[str] = "environment.user"
    kind: Literal["replay", "openai", "none"] = "replay"
    model: str | None = None  # openai: the served model name
    concurrency: Concurrency = 8
    timeout_s: TimeoutS = 60.0
    max_retries: MaxRetries = 4
    temperature: float = Field(0.0, ge=0)
    max_new_tokens: int = Field(256, ge=1)
    price_input_per_mtok: float = Field(0.0, ge=0)
    price_output_per_mtok: float = Field(0.0, ge=0)
    cache: str | None = ".flywheel/user-cache.sqlite"  # under the project root; null: none

    @model_validator(mode="before")
    @classmethod
    def _kind_alone(cls, data):
        return {"kind": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _usable(self) -> UserConfig:
        if self.kind == "openai" and not self.model:
            raise ValueError("user kind 'openai' needs 'model' (the served model name that plays the user)")
        return self


class EnvironmentConfig(Section):
    # A built-in (`calculator`, or an installed package's `flywheel.environments` entry point) by name, or any
    # factory "package.module:function" (importable from the project root) called with `args`. Not both.
    name: str | None = None
    factory: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    args: dict[str, Any] = {}
    # `name: replay` alone: every accepted trace is a task served from its record. Beside another environment:
    # the traces it can verify go to it, the rest to replay. The options apply to both (flywheel/envs/replay).
    replay: ReplayConfig | None = None
    train_tasks: int = Field(3000, ge=1)
    heldout_tasks: int = Field(200, ge=1)
    seed: int = 0
    # Assistant messages per episode (tool-calling turns and answers alike); a conversation still going then is
    # cut and counted (conversations_cut). max_episode_tokens: the same for the tokens the agent generated;
    # max_error_turns: for assistant turns in a row whose tool call was malformed (null: never). The harness's
    # Limits (flywheel/agent.py) are made from these.
    max_turns: int = Field(4, ge=1, le=64)
    max_episode_tokens: int | None = Field(None, ge=1)
    tool_timeout_s: float = Field(2.0, gt=0)
    max_error_turns: int | None = Field(None, ge=1)
    # Constrained decoding of tool calls (flywheel/policies/constrained.py): while the model writes a
    # `<tool_call>`, only tokens that keep it a valid call of an offered tool (arguments valid against its
    # schema) may be sampled; the policy's log-probabilities are those of the masked distribution. The harness
    # carries it (Limits.constrained), so synthesis, RL, evaluate and serving's loop sample under one setting;
    # a backend that cannot constrain (the oracle, a remote server) ignores it.
    constrained_tools: bool = False
    # Who answers the agent after it answers: replay tasks default to their recorded user turns (UserConfig);
    # an environment written with the SDK declares its own user (Env(user=...)).
    user: UserConfig = UserConfig()

    @model_validator(mode="after")
    def _one_source(self) -> EnvironmentConfig:
        if self.name and self.factory:
            raise ValueError(f"set either 'name' ({self.name}) or 'factory' ({self.factory}), not both")
        if not self.name and not self.factory:
            object.__setattr__(self, "name", "calculator")  # the demo's environment when neither is given
        if self.name == "replay":
            if self.args:
                raise ValueError("replay takes no args: its options go under environment.replay")
            if self.replay is None:
                object.__setattr__(self, "replay", ReplayConfig())
        return self
