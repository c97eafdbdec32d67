"""Pydantic models of pipelines.yaml: every bad key or value is an error naming the file and the key.

One module a part of the file: sections.py (what every section is made of, the endpoint settings), environment.py,
collect.py, training.py (student, teacher, synthesize, sft, rl), evaluation.py (evaluate, gate); here the
pipeline, its schedule and trigger, and the loaders. Every model is importable from flywheel.config.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import yaml
from pydantic import Field, ValidationError, model_validator

from flywheel.config.collect import (
    REDACTION_KINDS,
    CollectConfig,
    FieldMapping,
    OutcomeRule,
    RedactionConfig,
    RedactionKind,
    SourceConfig,
)
from flywheel.config.environment import EnvironmentConfig, ReplayConfig, ReplayJudgeConfig, UserConfig
from flywheel.config.evaluation import EvaluateConfig, GateConfig, ReferenceConfig
from flywheel.config.sections import ConfigError, EndpointConfig, Section
from flywheel.config.training import (
    OBJECTIVES,
    LoRAConfig,
    Objective,
    OPDConfig,
    OPDObjective,
    RewardObjective,
    RewardOPDObjective,
    RLConfig,
    SFTConfig,
    StudentConfig,
    SynthesizeConfig,
    TeacherConfig,
    TinyModelConfig,
)

__all__ = ["OBJECTIVES", "REDACTION_KINDS", "CollectConfig", "ConfigError", "EndpointConfig", "EnvironmentConfig",
           "EvaluateConfig", "FieldMapping", "GateConfig", "LoRAConfig", "OPDConfig", "OPDObjective", "Objective",
           "OutcomeRule", "PipelineConfig", "PipelinesFile", "RLConfig", "RedactionConfig", "RedactionKind",
           "ReferenceConfig", "ReplayConfig", "ReplayJudgeConfig", "RewardOPDObjective", "RewardObjective",
           "SFTConfig", "ScheduleConfig", "Section", "SourceConfig", "StudentConfig", "SynthesizeConfig",
           "TeacherConfig", "TinyModelConfig", "TriggerConfig", "UserConfig", "load_pipeline", "load_pipelines"]


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
