"""Pydantic models of pipelines.yaml: every bad key or value is an error naming the file and the key.

One module a part of the file: sections.py (what every section is made of, the endpoint settings), environment.py,
collect.py, training.py (student, teacher, synthesize, sft, rl), evaluation.py (evaluate, gate); here the
pipeline, its schedule and trigger, and the loaders: each pipeline is checked on its own (load_each), so one
pipeline's bad key does not stop `flywheel check` or `flywheel run` of another. Every model is importable from
flywheel.config.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from types import UnionType
from typing import Annotated, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from flywheel.config.collect import (
    REDACTION_KINDS,
    CollectConfig,
    FieldMapping,
    OutcomeRule,
    RedactionConfig,
    RedactionKind,
    SourceConfig,
    TurnLayout,
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
           "SFTConfig", "ScheduleConfig", "Section", "SourceConfig", "StudentConfig", "SynthesizeConfig", "TurnLayout",
           "TeacherConfig", "TinyModelConfig", "TriggerConfig", "UserConfig", "load_each", "load_pipeline",
           "load_pipelines", "read_pipelines_file", "validate_pipeline"]


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
    # Only `environment` is required: a section left out takes its defaults, and the student's profile
    # (flywheel/train/students.py) fills what the pipeline leaves unset. dvc.yaml names as params only the
    # sections each pipeline writes (DVC refuses a params key missing from the file).
    environment: EnvironmentConfig
    student: StudentConfig = StudentConfig()
    teacher: TeacherConfig = TeacherConfig()
    collect: CollectConfig = CollectConfig()
    synthesize: SynthesizeConfig = SynthesizeConfig()
    sft: SFTConfig = SFTConfig()
    rl: RLConfig = RLConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    gate: GateConfig = GateConfig()
    schedule: ScheduleConfig | None = None  # none: no scheduled retrain (a trigger or a manual run still can)
    trigger: TriggerConfig | None = None  # none: no sensor watching the trace sources
    # The minutes a run may take, by `flywheel check`'s estimate (flywheel/estimate.py): over it, `flywheel run`
    # asks before starting (on a terminal) or stops with the estimate (without one; `--yes` runs anyway).
    # none: no limit. Not a stage's parameter: no cache or dvc.yaml reads it.
    budget_minutes: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _teacher_can_teach(self) -> PipelineConfig:
        if self.environment.replay is not None and self.teacher.policy == "oracle":
            raise ValueError("teacher.policy: the oracle cannot teach replay tasks (a recorded trace has no "
                             "scripted solver); use `policy: openai` (any OpenAI-compatible endpoint), or "
                             "`policy: none` to train on the accepted traces alone")
        if self.teacher.policy == "none" and not self.synthesize.include_accepted_traces:
            raise ValueError("teacher.policy none: without a teacher the accepted traces are the only SFT "
                             "targets; set synthesize.include_accepted_traces: true")
        if not self.collect.sources and self.needs_traces:
            raise ValueError("collect.sources is empty, but this pipeline's tasks or targets come from traces "
                             "(environment replay, or teacher.policy none): name at least one place traces come "
                             "from")
        if not self.collect.sources and self.trigger is not None:
            raise ValueError("trigger watches the trace sources for new traces, and collect.sources is empty: name "
                             "a source, or drop the trigger (a schedule retrains on a clock)")
        return self

    @property
    def needs_traces(self) -> bool:
        """Whether its tasks or its SFT targets come from traces (environment replay, or teacher.policy none), so
        it cannot start without any."""
        return self.environment.name == "replay" or self.teacher.policy == "none"

    def section_hash(self, *names: str) -> str:
        """A stable hash of the named sections, for cache keys and lineage tags."""
        data = {name: self.model_dump(mode="json")[name] for name in names}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


class PipelinesFile(Section):
    pipelines: dict[str, PipelineConfig]


# Names other tools give a key, mapped to this file's: an unknown key suggests ours only where it is valid there.
SYNONYMS = {"learning_rate": "lr", "max_steps": "steps", "num_steps": "steps", "train_steps": "steps",
            "max_seq_length": "max_length", "max_seq_len": "max_length", "seq_len": "max_length",
            "max_tokens": "max_new_tokens", "num_heads": "heads", "n_heads": "heads", "num_layers": "layers",
            "n_layers": "layers", "batch": "batch_size", "warmup": "warmup_steps", "env": "environment"}
# Keys a section takes as pipelines.yaml writes them that its model keeps elsewhere (rl.opd: in the objective).
_WRITTEN_KEYS: dict[type, tuple[str, ...]] = {RLConfig: ("opd",)}


def _where(loc: tuple) -> str:
    where = ".".join(str(part) for part in loc)
    # rl.opd as pipelines.yaml writes it, not where RLConfig keeps it (in the objective's variant)
    return re.sub(r"\brl\.objective\.(?:reward\+opd|opd)\.opd\b", "rl.opd", where)


def read_pipelines_file(path: str | Path = "pipelines.yaml") -> dict[str, object]:
    """The file's pipelines, name -> its section as written (unchecked); ConfigError for what spoils the whole
    file: missing, not YAML (with its line and column), no `pipelines:` mapping, a top-level key besides it."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: file not found (run from the project root, or pass --root)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(_yaml_error(path, err)) from None
    if not isinstance(raw, dict) or not isinstance(raw.get("pipelines"), dict):
        raise ConfigError(f"{path}: expected a top-level 'pipelines:' mapping of name -> pipeline")
    extra = [str(key) for key in raw if key != "pipelines"]
    if extra:
        raise ConfigError(f"{path}: {extra[0]}: unknown key; the file holds `pipelines:` alone")
    names = [name for name in raw["pipelines"] if not isinstance(name, str)]
    if names:
        raise ConfigError(f"{path}: pipelines.{names[0]}: a pipeline's name must be a string (quote it)")
    return raw["pipelines"]


def _yaml_error(path: Path, err: yaml.YAMLError) -> str:
    """One line: FILE:LINE:COL, what the parser says, and what to do."""
    mark = getattr(err, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    context = getattr(err, "context", None)
    started = getattr(err, "context_mark", None)
    if context and started is not None:
        context = f"{context} that starts at {started.line + 1}:{started.column + 1}"
    said = f"{problem} ({context})" if context else problem
    return (f"{where}: not valid YAML: {said}; fix the file there (indent with spaces, never tabs, by the same "
            "amount as the keys beside it; close every bracket and quote; quote a value holding ': ')")


def validate_pipeline(name: str, raw: object, path: str | Path = "pipelines.yaml") -> PipelineConfig:
    """One pipeline's section checked on its own; ConfigError naming the file and each bad key of it."""
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError("\n".join(_problem(Path(path), ("pipelines", name), e) for e in err.errors())) from None


def _problem(path: Path, prefix: tuple, e: dict) -> str:
    key = _where(prefix + tuple(e["loc"]))
    if e["type"] == "extra_forbidden":
        return f"{path}: {key}: unknown key; {_suggestion(tuple(e['loc']))}"
    if e["type"] == "missing":
        return f"{path}: missing key '{key}' (write `{{}}` to take the defaults)"
    # the value it got, unless that is a whole section (a check across its keys)
    got = repr(e.get("input"))
    got = got if len(got) <= 300 else got[:297] + "..."
    shown = "" if isinstance(e.get("input"), dict) else f" (got {got})"
    return f"{path}: {key}: {e['msg'].removeprefix('Value error, ')}{shown}"


def _suggestion(loc: tuple) -> str:
    """The valid key nearest the unknown one at loc (a place under a pipeline), or the keys valid there."""
    import difflib

    valid = _keys_at(loc[:-1])
    unknown = str(loc[-1])
    if not valid:
        return "see flywheel/config/ for the keys of this section"
    near = [SYNONYMS[unknown]] if SYNONYMS.get(unknown) in valid else \
        difflib.get_close_matches(unknown, valid, n=1, cutoff=0.6)
    if near:
        return f"did you mean '{near[0]}'?"
    return f"this section's keys are {', '.join(valid)}"


def _keys_at(loc: tuple) -> list[str]:
    """The keys the section at loc (a place under a pipeline, as pydantic reports it) takes."""
    here: list = [PipelineConfig]
    for part in loc:
        here = [inner for outer in here for inner in _inside(outer, part)]
    models = [kind for option in here for kind in _members(option) if isinstance(kind, type)
              and issubclass(kind, BaseModel)]
    keys = {key for kind in models for key in (*kind.model_fields, *_WRITTEN_KEYS.get(kind, ()))}
    return sorted(keys - {"kind"})  # `kind`: the variant's tag, written as the value of rl.objective


def _inside(kind, part) -> list:
    """What the value at `part` inside a value of type `kind` may be: a field's type, a list's item, a dict's
    value; a union's member that pydantic names by its tag (rl.objective's variants) or that has the field."""
    options = _members(kind)
    models = [m for m in options if isinstance(m, type) and issubclass(m, BaseModel)]
    tagged = [m for m in models if "kind" in m.model_fields and m.model_fields["kind"].default == part]
    if len(models) > 1 and tagged:
        return tagged
    found = [m.model_fields[part].annotation for m in models if isinstance(part, str) and part in m.model_fields]
    for option in options:
        origin, args = get_origin(option), get_args(option)
        if origin in (list, tuple) and isinstance(part, int) and args:
            found.append(args[0])
        elif origin is dict and len(args) == 2:
            found.append(args[1])
    return found


def _members(kind) -> list:
    """A type's alternatives: a union's members (Optional and Annotated unwrapped), else the type itself."""
    if get_origin(kind) is Annotated:
        return _members(get_args(kind)[0])
    if get_origin(kind) in (Union, UnionType):
        return [m for arg in get_args(kind) for m in _members(arg)]
    return [kind]


def load_each(path: str | Path = "pipelines.yaml") -> dict[str, PipelineConfig | ConfigError]:
    """Every pipeline checked on its own, name -> its config or its ConfigError: one pipeline's bad key does not
    stop the others (`flywheel check`); ConfigError for what spoils the whole file."""
    each: dict[str, PipelineConfig | ConfigError] = {}
    for name, raw in read_pipelines_file(path).items():
        try:
            each[name] = validate_pipeline(name, raw, path)
        except ConfigError as err:
            each[name] = err
    return each


def load_pipelines(path: str | Path = "pipelines.yaml") -> dict[str, PipelineConfig]:
    """Read and validate every pipeline in the file; raise ConfigError naming the file and key."""
    each = load_each(path)
    problems = [str(found) for found in each.values() if isinstance(found, ConfigError)]
    if problems:
        raise ConfigError("\n".join(problems))
    return each


def load_pipeline(name: str, path: str | Path = "pipelines.yaml") -> PipelineConfig:
    """One pipeline by name, checked alone (another pipeline's bad key does not stop it); an unknown name lists
    the ones the file has."""
    pipelines = read_pipelines_file(path)
    if name not in pipelines:
        raise ConfigError(f"{path}: no pipeline named '{name}' (have: {', '.join(sorted(pipelines))})")
    return validate_pipeline(name, pipelines[name], path)
