"""Pydantic models of pipelines.yaml: every bad key or value is an error naming the file and the key."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer, model_validator

from flywheel.devices import DEVICE_PATTERN
from flywheel.errors import UserFacingError


class ConfigError(UserFacingError, ValueError):
    """pipelines.yaml is missing, unreadable or invalid; the message names the file and the key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# The limits of an endpoint's client, with their bounds; a section whose defaults differ restates the default only.
Concurrency = Annotated[int, Field(ge=1, le=512)]  # requests in flight at once
TimeoutS = Annotated[float, Field(gt=0)]  # per request; a hang past it is retried
MaxRetries = Annotated[int, Field(ge=0, le=20)]  # per request, on 429, 5xx, timeouts and dropped connections


class EndpointConfig(Section):
    """A server over the OpenAI protocol and how its client talks to it (flywheel/policies/openai.py): the
    sections that call one (teacher, environment.user, environment.replay.judge, evaluate.references, rl.opd)."""

    where: ClassVar[str]  # the section's key in pipelines.yaml, for the client's messages

    # e.g. http://localhost:8000/v1 (vLLM's server); unset: the client's default (OPENAI_BASE_URL or OpenAI's)
    base_url: str | None = None
    # The NAME of the environment variable holding the key; a key itself never goes in this file.
    api_key_env: str | None = Field(None, pattern=r"^[A-Z_][A-Z0-9_]*$")
    concurrency: Concurrency = 16
    timeout_s: TimeoutS = 120.0
    max_retries: MaxRetries = 6
    # this many failed attempts in a row (any request) mean the endpoint is down: the stage stops
    breaker_failures: int = Field(10, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _hide_pasted_keys(cls, data):
        # A value that is not an UPPER_CASE variable name may be a pasted key: the error must not print it.
        value = data.get("api_key_env") if isinstance(data, dict) else None
        if isinstance(value, str) and not (value.isascii() and value.isidentifier() and value == value.upper()):
            data = {**data, "api_key_env": "<hidden: must be the NAME of the environment variable holding the "
                                           "key, e.g. OPENAI_API_KEY, never the key itself>"}
        return data


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

    # Tool names that only read (case-insensitive regex, matched at the start); every other recorded call is a
    # write the rubric requires, with matching arguments, none missing and none extra.
    reads: str = "get|list|search|find|lookup|read"
    # Free text (string arguments of two words or more) matches when the word overlap (Jaccard) reaches this;
    # 1.0: normalised text must be equal. Ids, numbers and one-word strings always match exactly (normalised).
    fuzzy: float = Field(0.8, gt=0, le=1)
    writes_weight: float = Field(0.5, ge=0)
    facts_weight: float = Field(0.5, ge=0)
    judge: ReplayJudgeConfig | None = None  # none: the rubric is deterministic
    # Rejected traces are never targets; "eval": each becomes a held-out task whose rubric is inverted (1 when
    # the model does not repeat what was rejected), in its own slice.
    rejected: Literal["drop", "eval"] = "drop"

    @model_validator(mode="after")
    def _usable(self) -> ReplayConfig:
        try:
            re.compile(self.reads)
        except re.error as err:
            raise ValueError(f"reads {self.reads!r} is not a valid regex: {err}") from None
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


class TinyModelConfig(Section):
    hidden_size: int = Field(128, ge=16)
    layers: int = Field(2, ge=1)
    heads: int = Field(4, ge=1)
    vocab_size: int = Field(512, ge=300)
    max_position_embeddings: int = Field(512, ge=64)
    # Spaces as tokens of their own, so a word is the same token after a space as after a quote: a name copied
    # from "Hi, I'm ana.lee@..." into {"email": "ana.lee@..."} is then a copy, not a learned per-name mapping.
    isolate_spaces: bool = False
    seed: int = 0

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> TinyModelConfig:
        if self.hidden_size % self.heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by heads {self.heads}")
        return self


class StudentConfig(Section):
    # "tiny" builds the demo student from scratch; "auto" picks tiny for short prompts and SmolLM2-135M-Instruct for
    # long ones (flywheel/train/students.py); anything else is a checkpoint folder, a hub id or a GGUF file.
    model: str = "tiny"
    tiny: TinyModelConfig = TinyModelConfig()
    # A .jinja file (under the project root) with {% generation %} markers, for a student whose own template has
    # none and is not one TRL ships a training version of. When set it is used in place of the student's own.
    chat_template: str | None = None
    # Where the student trains and runs in sft, rl (the learner; actors too unless rl.actor_devices) and evaluate:
    # auto (a CUDA GPU when one is visible, else the CPU), cpu, cuda or cuda:N (sft: cuda:0 only; pick another GPU
    # with CUDA_VISIBLE_DEVICES). Naming a GPU the machine lacks is an error, never a fall back to the CPU.
    device: str = Field("auto", pattern=DEVICE_PATTERN)


class TeacherConfig(EndpointConfig):
    where: ClassVar[str] = "teacher"
    # none: no teacher at all; the accepted traces are the only targets (synthesize.include_accepted_traces)
    policy: Literal["oracle", "openai", "vllm", "hf", "none"] = "oracle"
    # openai: the served model name; vllm and hf: a checkpoint folder or hub id
    model: str | None = None
    price_input_per_mtok: float = Field(0.0, ge=0)  # USD per million prompt tokens
    price_output_per_mtok: float = Field(0.0, ge=0)  # USD per million completion tokens
    # SQLite response cache under the project root (null: none): reruns make no calls, a killed run resumes
    cache: str | None = ".flywheel/teacher-cache.sqlite"
    # hf and vllm teachers (local models): auto, cpu, cuda or cuda:N, as student.device; vllm needs a GPU
    device: str = Field("auto", pattern=DEVICE_PATTERN)
    # oracle only, an imperfect teacher as real ones are: this fraction of its final answers is wrong (a number
    # in it is off), chosen by a hash of (error_seed, conversation), so reruns make the same mistakes. The rubric
    # rejects them, so the student sees fewer targets where the teacher errs. error_slices: only tasks of these
    # slices (as the environment's task_from_messages reads them); empty: every slice.
    error_rate: float = Field(0.0, ge=0, le=1)
    error_slices: list[str] = []
    error_seed: int = 0

    @model_validator(mode="after")
    def _usable(self) -> TeacherConfig:
        if self.policy not in ("oracle", "none") and not self.model:
            raise ValueError(f"teacher policy '{self.policy}' needs 'model' (the served model name, "
                             "or a checkpoint for vllm and hf)")
        if self.policy != "oracle" and (self.error_rate or self.error_slices):
            raise ValueError(f"error_rate and error_slices make the oracle imperfect; teacher policy "
                             f"'{self.policy}' makes its own mistakes (set them only with policy: oracle)")
        if self.policy == "vllm" and self.device == "cpu":
            raise ValueError("teacher policy 'vllm' runs on a GPU only: device cpu is not possible (use hf on "
                             "the CPU, or openai against a vLLM server)")
        return self


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


class OutcomeRule(Section):
    """accepted/rejected/unknown from the outcome field's value (a flag is a true/false field), else the score."""

    accepted: list[str | bool | int] = ["accepted"]
    rejected: list[str | bool | int] = ["rejected"]
    unknown: list[str | bool | int] = ["unknown"]
    # When the outcome field is absent: score >= threshold is accepted, below it rejected; None: unknown.
    score_threshold: float | None = None


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
    # A string is a glob under the project root, `s3://bucket/prefix`, or `mlflow:EXPERIMENT`.
    sources: list[SourceConfig] = [SourceConfig(path=["examples/traces/*.jsonl"])]
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


class SynthesizeConfig(Section):
    samples_per_task: int = Field(1, ge=1)  # rejection sampling: n teacher episodes per train task
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(512, ge=1)  # per assistant turn
    keep_best_only: bool = False  # accept at most one passing sample per task (highest reward, then shortest)
    include_accepted_traces: bool = False  # train traces with outcome 'accepted' become targets too
    # Train tasks of these slices get no teacher conversation: SFT never sees them; they stay RL tasks and held-out
    # slices. support-smol leaves out `hard` (several requests in one message): its conversations taught the
    # student to call get_order again on the desk's single requests, and they were 27% of SFT's tokens.
    exclude_slices: list[str] = Field(default_factory=list)


class LoRAConfig(Section):
    r: int = Field(16, ge=1)
    alpha: int = Field(32, ge=1)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: str | list[str] = "all-linear"
    # QLoRA: the frozen base loaded in 4 or 8 bits (bitsandbytes, CUDA only); None keeps it in full precision.
    quantize: Literal["4bit", "8bit"] | None = None
    # "merged": the adapter is folded into the base and the student is a plain checkpoint;
    # "adapter": the student is the adapter folder, registered with its base named.
    save: Literal["merged", "adapter"] = "merged"


class SFTConfig(Section):
    steps: int = Field(600, ge=1)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(1e-3, gt=0)  # at 2e-3 the tiny student learns digit copying late or not (by seed)
    warmup_steps: int = Field(30, ge=0)
    max_length: int = Field(128, ge=16)
    seed: int = 0
    log_every: int = Field(10, ge=1)
    # A conversation longer than max_length is cut to it ("truncate") or left out ("drop"); either is counted.
    long_conversations: Literal["truncate", "drop"] = "truncate"
    # Fraction of the conversations held out (by content hash) for an eval loss every eval_every steps; 0: none.
    eval_fraction: float = Field(0.02, ge=0, lt=0.5)
    eval_every: int = Field(100, ge=1)
    lora: LoRAConfig | None = None  # None: full fine-tuning (the default for small students)
    # bf16: forward and backward under bfloat16 autocast (weights, gradients and optimiser state stay fp32). On
    # a CPU with native bf16 (AVX-512 BF16 or AMX) a LoRA step of SmolLM2 runs 2.1x faster, its loss within 0.04
    # of fp32's (benchmarks/smol.py); elsewhere bf16 is emulated and slower: keep fp32 there.
    precision: Literal["fp32", "bf16"] = "fp32"
    # "single": in this process; "ddp"/"fsdp": `accelerate launch` with infra/accelerate/<launcher>.yaml.
    launcher: Literal["single", "ddp", "fsdp"] = "single"
    processes: int = Field(2, ge=1)  # processes accelerate starts (one per GPU; gloo on CPU)


class OPDConfig(EndpointConfig):
    """On-policy distillation (rl.objective opd or reward+opd): the teacher judges every token the student wrote.
    `sampled`: its log-probability of the sampled token gives that token the advantage -kl_coef * (log p_student
    - log p_teacher); `reverse` / `forward`: kl_coef times the exact KL over the vocabulary is a loss term."""

    # A checkpoint folder (under the project root, or absolute) whose tokenizer is the student's; with base_url,
    # the model name a server over the OpenAI protocol serves (vLLM: its completions API with prompt_logprobs).
    # A server is retried like the teacher's client (429, 5xx, timeouts); past the retries the step's groups are
    # dropped and counted, never trained on without the teacher.
    where: ClassVar[str] = "rl.opd"
    teacher: str
    kl_coef: float = Field(1.0, gt=0)  # the weight of the per-token divergence from the teacher
    # sampled: the reverse KL estimated at the token the student sampled, as that token's advantage (any teacher);
    # reverse / forward: the exact KL(student || teacher) / KL(teacher || student) over the whole vocabulary at
    # each position the student wrote, a loss term beside the policy loss (a local checkpoint only: a server
    # gives the sampled token's log-probability, not the distribution)
    divergence: Literal["sampled", "reverse", "forward"] = "sampled"
    reward_coef: float = Field(1.0, ge=0)  # reward+opd: the weight of the group advantage of the task reward
    device: str = Field("auto", pattern=DEVICE_PATTERN)  # a local teacher's (the learner runs it)
    # a token whose teacher log-probability is NaN or infinite leaves the loss (counted); past this share of
    # the run's tokens the run stops with an error
    max_nonfinite_fraction: float = Field(0.01, ge=0, le=1)

    @model_validator(mode="after")
    def _whole_distribution_is_local(self) -> OPDConfig:
        if self.divergence != "sampled" and self.base_url:
            raise ValueError(
                f"divergence '{self.divergence}' takes the teacher's whole distribution at every token, which only "
                f"a local checkpoint gives; the server at {self.base_url} returns the log-probability of the token "
                "the student sampled (prompt_logprobs). Use divergence: sampled with a server, or a checkpoint "
                "folder as rl.opd.teacher without rl.opd.base_url")
        return self


class RewardObjective(Section):
    """rl.objective reward (grpo): GRPO-family group advantages of the task reward; no teacher."""

    kind: Literal["reward"] = "reward"
    opd: None = None  # every objective has `opd`: the teacher's settings, or none


class OPDObjective(Section):
    """rl.objective opd: on-policy distillation alone; the teacher judges every token, the reward is unused."""

    kind: Literal["opd"] = "opd"
    opd: OPDConfig


class RewardOPDObjective(Section):
    """rl.objective reward+opd: the reward's group advantage (times opd.reward_coef) beside the teacher's."""

    kind: Literal["reward+opd"] = "reward+opd"
    opd: OPDConfig


# What the learner's advantages come from; flywheel/train/rl/objective.py holds what each one does.
Objective = Annotated[RewardObjective | OPDObjective | RewardOPDObjective, Field(discriminator="kind")]
OBJECTIVES = ("reward", "opd", "reward+opd")


class RLConfig(Section):
    steps: int = Field(10, ge=0)
    tasks_per_step: int = Field(16, ge=1)
    group_size: int = Field(4, ge=1)  # reward objectives need 2 or more: a group is scored against itself
    # What the learner's advantages come from: the task reward (GRPO-family group advantages; `grpo` names it
    # too), the teacher's per-token judgement of the student's own samples (on-policy distillation, `opd`), or
    # both. Written `objective: opd` with the teacher's settings beside it (`opd: {teacher: ...}`); read as one
    # variant that holds them (cfg.objective.opd), so an OPD objective without its teacher cannot be built.
    objective: Objective = RewardObjective()
    temperature: float = Field(1.0, gt=0)
    max_new_tokens: int = Field(64, ge=1)  # per assistant turn
    lr: float = Field(3e-5, gt=0)  # 2e-4 and above break the tiny student's digit copying (measured)
    clip_eps: float = Field(0.2, gt=0)
    epochs_per_batch: int = Field(2, ge=1)
    minibatch_size: int = Field(32, ge=1)
    max_grad_norm: float = Field(1.0, gt=0)
    # grpo: mean per sequence, then over sequences; dr_grpo: token sum / (sequences * max_length), advantages
    # not divided by the group std; dapo: mean over every assistant token of the minibatch.
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = "grpo"
    max_length: int = Field(128, ge=16)
    seed: int = 0
    # Asynchronous rollouts: actor processes generate while the learner steps. Step s learns from groups made
    # by exactly policy version max(s - max_staleness, 0) (reproducible); 0 is the synchronous baseline (actors
    # wait for each new version). actors: 0 generates in the learner's own process, taking turns with learning.
    actors: int = Field(1, ge=0)
    max_staleness: int = Field(1, ge=0)
    tis_cap: float = Field(2.0, gt=0)  # truncated importance sampling: weights pi_old/pi_behaviour capped here
    kl_beta: float = Field(0.0, ge=0)  # KL to the starting checkpoint (frozen reference); 0: no reference kept
    # torch threads of the learner and of each actor: on a small machine one actor + the learner must not
    # oversubscribe the cores, or overlapping them is slower than taking turns.
    learner_threads: int = Field(1, ge=1)
    actor_threads: int = Field(1, ge=1)
    # The actors' engine: transformers (CPU/GPU) or vLLM (GPU; needs actors >= 1: it runs in an actor process).
    generation: Literal["hf", "vllm"] = "hf"
    # One device per actor (auto, cpu, cuda, cuda:N), e.g. [cuda:1, cuda:2] beside a learner on cuda:0;
    # empty: every actor on student.device.
    actor_devices: list[str] = []
    checkpoint_every: int = Field(5, ge=0)  # learner steps between resumable checkpoints; 0: none
    # The learning rate over the run: constant, or after `warmup_steps` (linear from 0) a cosine or linear decay
    # to lr * min_lr_ratio at the last step. Per learner step, so a resumed run continues the same schedule.
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    # Online difficulty filtering (DAPO, prime-rl): a task whose last `filter_window` groups were all-pass or
    # all-fail (no signal) is drawn with weight `filter_weight` instead of 1. Step s's tasks depend only on the
    # seed and the groups of steps before s - max_staleness, so reruns and resumed runs draw the same tasks.
    difficulty_filter: bool = False
    filter_window: int = Field(1, ge=1)
    filter_weight: float = Field(0.1, ge=0, le=1)
    # Reward-hacking monitor: every `monitor_every` steps (and before the first) the current policy answers a
    # fixed sample of `monitor_tasks` held-out tasks greedily; audit_pass is the share that passes the
    # environment's audit checks (its rubric's `passed` when it declares none). A run whose training reward
    # rose while audit_pass fell by more than `max_audit_drop` from its first value is flagged. 0: off.
    monitor_every: int = Field(0, ge=0)
    monitor_tasks: int = Field(32, ge=1)
    max_audit_drop: float = Field(0.1, ge=0, le=1)
    # Early stopping: `validate_tasks` train tasks (the first by task id) are taken out of the tasks RL draws
    # from; every `validate_every` steps (and before the first) the policy answers them greedily, and the run's
    # output is the version that passed the most (ties: the higher mean reward, then the earlier version;
    # version 0 is the starting checkpoint), not the last. Off: the last version.
    keep_best: bool = False
    validate_every: int = Field(10, ge=1)
    validate_tasks: int = Field(64, ge=1)
    # RL that changed nothing (0 optimiser updates: every group had equal rewards, or an output byte-identical to
    # the SFT checkpoint) is a warning in the run's summary and an MLflow tag; true: the stage fails instead.
    fail_on_no_updates: bool = False

    @model_validator(mode="before")
    @classmethod
    def _objective_as_written(cls, data):
        """`objective: <name>` with `opd: {...}` beside it, as pipelines.yaml says it, into one variant."""
        if not isinstance(data, dict) or isinstance(data.get("objective"), dict | BaseModel):
            return data  # a variant already (or not a mapping: the model's own error says so)
        data = dict(data)
        kind = data.pop("objective", "reward")
        kind = "reward" if kind == "grpo" else kind  # the name the GRPO family goes by elsewhere (prime-rl)
        opd = data.pop("opd", None)  # beside `reward` it was never read
        if kind not in OBJECTIVES:
            raise ValueError(f"objective {kind!r}: use reward (or grpo), opd or reward+opd")
        if kind != "reward" and opd is None:
            raise ValueError(f"objective '{kind}' needs rl.opd with a teacher: a checkpoint folder with "
                             "the student's tokenizer, or a served model name and base_url")
        return data | {"objective": {"kind": kind} | ({"opd": opd} if kind != "reward" else {})}

    @model_serializer(mode="wrap")
    def _written_back(self, handler) -> dict:
        """Dumped as written (`objective: <name>`, then `opd`), so a dumped config loads back and its hash and
        recorded copy read as before the objective became a variant."""
        written = {}
        for name, value in handler(self).items():
            if name == "objective":
                written["objective"] = value["kind"]
                if "opd" in value:  # (not when exclude_none leaves it out)
                    written["opd"] = value["opd"]
            else:
                written[name] = value
        return written

    @model_validator(mode="after")
    def _actors_fit(self) -> RLConfig:
        if self.objective.kind != "opd" and self.group_size < 2:
            raise ValueError(f"group_size {self.group_size}: objective '{self.objective.kind}' scores each task's "
                             "samples against each other, so it needs 2 or more (only 'opd' can take 1)")
        if self.generation == "vllm" and self.actors == 0:
            raise ValueError("generation 'vllm' needs actors >= 1: the vLLM engine runs in an actor process, and "
                             "with actors 0 the learner generates with transformers itself")
        bad = [d for d in self.actor_devices if not re.fullmatch(DEVICE_PATTERN, d)]
        if bad:
            raise ValueError(f"actor_devices {bad}: use auto, cpu, cuda or cuda:N")
        if self.actor_devices and len(self.actor_devices) != self.actors:
            raise ValueError(f"actor_devices names {len(self.actor_devices)} device(s) for {self.actors} actor(s): "
                             "give one per actor, or none (every actor on student.device)")
        if self.generation == "vllm" and "cpu" in self.actor_devices:
            raise ValueError("generation 'vllm' runs on a GPU only: an actor on cpu is not possible")
        return self


class ReferenceConfig(EndpointConfig):
    """A policy scored beside the candidate on the same held-out tasks (evaluate.references); never gated on.
    openai: retried like the teacher; past the retries (or the breaker) its row is marked incomplete."""

    where: ClassVar[str] = "evaluate.references"
    name: str = Field(pattern=r"^[A-Za-z][A-Za-z0-9_.-]*$")  # its row in the eval table; not a model's label
    policy: Literal["openai", "hf", "vllm"] = "openai"
    model: str  # openai: the served model name; hf and vllm: a checkpoint folder or hub id
    price_input_per_mtok: float = Field(0.0, ge=0)  # USD per million prompt tokens
    price_output_per_mtok: float = Field(0.0, ge=0)  # USD per million completion tokens
    cache: str | None = ".flywheel/reference-cache.sqlite"  # under the project root; null: none
    device: str = Field("auto", pattern=DEVICE_PATTERN)  # hf and vllm


class EvaluateConfig(Section):
    # Greedy decoding on every held-out task (sample 0), plus `samples` episodes per task at `temperature`
    # (samples 1..k, seeded, so candidate and champion draw with the same seeds). The gate pairs every row.
    batch_size: int = Field(64, ge=1)
    # bf16: the students generate under bfloat16 autocast (flywheel/policies/hf.py), about twice as fast on a CPU
    # with native bf16; every arm (base, sft, rl, champion) alike, so the gate compares like with like
    precision: Literal["fp32", "bf16"] = "fp32"
    samples: int = Field(0, ge=0)
    temperature: float = Field(1.0, gt=0)
    seed: int = 0
    # Other policies scored on the same tasks (typically the production model the traces came from): the summary
    # and the registry tags say what share of a reference's pass rate the candidate reaches, at what share of its
    # cost per task. The students' cost per task uses these prices (USD per million tokens; 0: unpriced).
    references: list[ReferenceConfig] = []
    student_price_input_per_mtok: float = Field(0.0, ge=0)
    student_price_output_per_mtok: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _distinct_references(self) -> EvaluateConfig:
        names = [r.name for r in self.references]
        models = ("null", "base", "sft", "rl", "champion")  # the rows evaluate scores itself
        taken = sorted({n for n in names if names.count(n) > 1 or n in models})
        if taken:
            raise ValueError(f"references {taken}: each needs its own name, other than {', '.join(models)}")
        return self


class GateConfig(Section):
    min_score: float = Field(0.8, ge=0, le=1)
    # "improve": the bootstrap lower bound of (candidate - champion) must exceed margin;
    # "non_inferior": it must exceed -margin;
    # "cost_aware": non-inferior, and cheaper than the champion in mean `cost_metric` per task: the lower bound
    # of the relative saving (1 - candidate / champion) must reach min_token_saving.
    mode: Literal["improve", "non_inferior", "cost_aware"] = "non_inferior"
    min_token_saving: float = Field(0.1, ge=0, lt=1)
    cost_metric: Literal["tokens", "latency_s"] = "tokens"
    margin: float = Field(0.03, ge=0, le=1)
    max_slice_regression: float = Field(0.05, ge=0, le=1)
    bootstrap_samples: int = Field(2000, ge=100)
    confidence: float = Field(0.95, gt=0.5, lt=1)
    seed: int = 0
    # Optional limits on the candidate's mean per task (eval columns `tokens` and `latency_s`); off when unset.
    max_tokens_per_task: float | None = Field(None, gt=0)
    max_latency_s: float | None = Field(None, gt=0)
    # The gate refuses what the eval cannot measure (each check on by default): fewer held-out tasks than
    # min_tasks (0: off); the null policy (an empty answer) within `margin` of the candidate (paired lower bound);
    # base so near 1 that candidate - base cannot clear `margin` even for a perfect candidate; a slice where
    # every model (null, base, sft, candidate, champion) scores the same.
    min_tasks: int = Field(20, ge=0)
    check_null: bool = True
    check_ceiling: bool = True
    check_flat_slices: bool = True
    # Slices the gate reports but does not judge on their own (a harder slice no model solves yet, kept in the
    # held-out set to be measured): the flat-slice check and max_slice_regression skip them; their tasks still
    # count in every overall figure.
    report_only_slices: list[str] = Field(default_factory=list)


class ScheduleConfig(Section):
    """When the retrain deployment runs (`flywheel serve` / `flywheel deploy`): a 5-field cron in a timezone."""

    cron: str
    timezone: str = "UTC"  # IANA name; the cron is read in it (so 03:00 stays 03:00 across DST)

    @model_validator(mode="after")
    def _valid(self) -> ScheduleConfig:
        from datetime import datetime
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        from cronsim import CronSim, CronSimError

        try:
            CronSim(self.cron, datetime(2026, 1, 1))
        except CronSimError as err:
            raise ValueError(f"cron {self.cron!r} is not a 5-field cron expression ({err}), "
                             "e.g. '0 3 * * 1' for Mondays at 03:00") from None
        try:
            ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"timezone {self.timezone!r} is not an IANA time zone, e.g. 'UTC' or "
                             "'Europe/Berlin'") from None
        return self


class TriggerConfig(Section):
    """Retrain when enough new traces arrived: the `watch-traces` deployment checks the sources every `every_s`."""

    min_new_traces: int = Field(ge=1)  # records newer than collect's watermarks, counted across the sources
    every_s: int = Field(300, ge=10)  # how often the sensor looks (it reads file sizes and listings, not records)


class PipelineConfig(Section):
    # Every stage section is required (`{}` takes the defaults): dvc.yaml reads each one as params, and
    # DVC refuses a params key that is missing from the file.
    environment: EnvironmentConfig
    student: StudentConfig
    teacher: TeacherConfig
    collect: CollectConfig
    synthesize: SynthesizeConfig
    sft: SFTConfig
    rl: RLConfig
    evaluate: EvaluateConfig
    gate: GateConfig
    schedule: ScheduleConfig | None = None  # none: no scheduled retrain (a trigger or a manual run still can)
    trigger: TriggerConfig | None = None  # none: no sensor watching the trace sources

    @model_validator(mode="after")
    def _teacher_can_teach(self) -> PipelineConfig:
        if self.environment.replay is not None and self.teacher.policy == "oracle":
            raise ValueError("teacher.policy: the oracle cannot teach replay tasks (a recorded trace has no "
                             "scripted solver); use `policy: openai` (any OpenAI-compatible endpoint), or "
                             "`policy: none` to train on the accepted traces alone")
        if self.teacher.policy == "none" and not self.synthesize.include_accepted_traces:
            raise ValueError("teacher.policy none: without a teacher the accepted traces are the only SFT "
                             "targets; set synthesize.include_accepted_traces: true")
        if not self.collect.sources and (self.environment.name == "replay" or self.teacher.policy == "none"):
            raise ValueError("collect.sources is empty, but this pipeline's tasks or targets come from traces "
                             "(environment replay, or teacher.policy none): name at least one place traces come "
                             "from")
        if not self.collect.sources and self.trigger is not None:
            raise ValueError("trigger watches the trace sources for new traces, and collect.sources is empty: name "
                             "a source, or drop the trigger (a schedule retrains on a clock)")
        return self

    def section_hash(self, *names: str) -> str:
        """A stable hash of the named sections, for cache keys and lineage tags."""
        data = {name: self.model_dump(mode="json")[name] for name in names}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


class PipelinesFile(Section):
    pipelines: dict[str, PipelineConfig]


def _where(loc: tuple) -> str:
    where = ".".join(str(part) for part in loc)
    # rl.opd as pipelines.yaml writes it, not where RLConfig keeps it (in the objective's variant)
    return re.sub(r"\brl\.objective\.(?:reward\+opd|opd)\.opd\b", "rl.opd", where)


def load_pipelines(path: str | Path = "pipelines.yaml") -> dict[str, PipelineConfig]:
    """Read and validate every pipeline in the file; raise ConfigError naming the file and key."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: file not found (run from the project root, or pass --config)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
    if not isinstance(raw, dict) or "pipelines" not in raw:
        raise ConfigError(f"{path}: expected a top-level 'pipelines:' mapping of name -> pipeline")
    try:
        return PipelinesFile.model_validate(raw).pipelines
    except ValidationError as err:
        problems = []
        for e in err.errors():
            key = _where(e["loc"])
            if e["type"] == "extra_forbidden":
                problems.append(f"{path}: unknown key '{key}' (misspelt?)")
            elif e["type"] == "missing":
                problems.append(f"{path}: missing key '{key}' (write `{{}}` to take the defaults)")
            else:  # the value it got, unless that is a whole section (a check across its keys)
                got = repr(e.get("input"))
                got = got if len(got) <= 300 else got[:297] + "..."
                shown = "" if isinstance(e.get("input"), dict) else f" (got {got})"
                problems.append(f"{path}: {key}: {e['msg'].removeprefix('Value error, ')}{shown}")
        raise ConfigError("\n".join(problems)) from None


def load_pipeline(name: str, path: str | Path = "pipelines.yaml") -> PipelineConfig:
    """One pipeline by name; an unknown name lists the ones the file has."""
    pipelines = load_pipelines(path)
    if name not in pipelines:
        raise ConfigError(f"{path}: no pipeline named '{name}' (have: {', '.join(sorted(pipelines))})")
    return pipelines[name]
