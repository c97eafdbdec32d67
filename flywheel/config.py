"""Pydantic models of pipelines.yaml: every bad key or value is an error naming the file and the key."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """pipelines.yaml is missing, unreadable or invalid; the message names the file and the key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EnvironmentConfig(Section):
    name: str = "calculator"
    train_tasks: int = Field(3000, ge=1)
    heldout_tasks: int = Field(200, ge=1)
    seed: int = 0
    max_turns: int = Field(4, ge=1, le=32)
    tool_timeout_s: float = Field(2.0, gt=0)


class TinyModelConfig(Section):
    hidden_size: int = Field(128, ge=16)
    layers: int = Field(2, ge=1)
    heads: int = Field(4, ge=1)
    vocab_size: int = Field(512, ge=300)
    max_position_embeddings: int = Field(256, ge=64)
    seed: int = 0

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> TinyModelConfig:
        if self.hidden_size % self.heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by heads {self.heads}")
        return self


class StudentConfig(Section):
    # "tiny" builds the demo student from scratch; anything else is a checkpoint folder or a hub id.
    model: str = "tiny"
    tiny: TinyModelConfig = TinyModelConfig()


class TeacherConfig(Section):
    policy: Literal["oracle", "openai", "hf"] = "oracle"
    model: str | None = None
    base_url: str | None = None
    # The NAME of the environment variable holding the key; a key itself never goes in this file.
    api_key_env: str | None = None


class CollectConfig(Section):
    sources: list[str] = ["examples/traces/*.jsonl"]
    heldout_fraction: float = Field(0.1, gt=0, lt=1)
    max_bad_fraction: float = Field(0.2, ge=0, le=1)


class SynthesizeConfig(Section):
    samples_per_task: int = Field(1, ge=1)
    temperature: float = Field(0.0, ge=0)


class SFTConfig(Section):
    steps: int = Field(600, ge=1)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(2e-3, gt=0)
    warmup_steps: int = Field(30, ge=0)
    max_length: int = Field(128, ge=16)
    seed: int = 0
    log_every: int = Field(10, ge=1)


class RLConfig(Section):
    steps: int = Field(10, ge=0)
    tasks_per_step: int = Field(16, ge=1)
    group_size: int = Field(4, ge=2)
    temperature: float = Field(1.0, gt=0)
    lr: float = Field(1e-4, gt=0)
    clip_eps: float = Field(0.2, gt=0)
    epochs_per_batch: int = Field(2, ge=1)
    minibatch_size: int = Field(32, ge=1)
    max_grad_norm: float = Field(1.0, gt=0)
    loss_type: Literal["grpo", "dr_grpo"] = "grpo"
    max_length: int = Field(128, ge=16)
    seed: int = 0


class EvaluateConfig(Section):
    # Greedy decoding on every held-out task; k samples at a temperature is the gate issue's extension.
    batch_size: int = Field(64, ge=1)


class GateConfig(Section):
    min_score: float = Field(0.8, ge=0, le=1)
    # "improve": the bootstrap lower bound of (candidate - champion) must exceed margin;
    # "non_inferior": it must exceed -margin.
    mode: Literal["improve", "non_inferior"] = "non_inferior"
    margin: float = Field(0.02, ge=0, le=1)
    max_slice_regression: float = Field(0.05, ge=0, le=1)
    bootstrap_samples: int = Field(2000, ge=100)
    confidence: float = Field(0.95, gt=0.5, lt=1)
    seed: int = 0


class ScheduleConfig(Section):
    cron: str
    timezone: str = "UTC"


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
    schedule: ScheduleConfig | None = None

    def section_hash(self, *names: str) -> str:
        """A stable hash of the named sections, for cache keys and lineage tags."""
        data = {name: self.model_dump(mode="json")[name] for name in names}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


class PipelinesFile(Section):
    pipelines: dict[str, PipelineConfig]


def _where(loc: tuple) -> str:
    return ".".join(str(part) for part in loc)


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
            else:
                problems.append(f"{path}: {key}: {e['msg']} (got {e.get('input')!r})")
        raise ConfigError("\n".join(problems)) from None


def load_pipeline(name: str, path: str | Path = "pipelines.yaml") -> PipelineConfig:
    """One pipeline by name; an unknown name lists the ones the file has."""
    pipelines = load_pipelines(path)
    if name not in pipelines:
        raise ConfigError(f"{path}: no pipeline named '{name}' (have: {', '.join(sorted(pipelines))})")
    return pipelines[name]
