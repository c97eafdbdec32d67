"""The stages of a pipeline as plain data: their names in order, what a stage returns (StageResult, and the
evaluate stage's GateReport), what a run of them all returns (RetrainSummary).

Both sides read this: tasks/ (the stages themselves, run by Prefect) and the parts of flywheel/ that read what
the stages recorded (flywheel/status.py, the serving loop), which may not import tasks/. ORDER is the one list
of the stages: tasks/spec.py holds each one's inputs, config sections, code and outputs, keyed and ordered by it.

A report or summary is written and read here only: to_dict is what gate.json holds, from_dict the one place a
shape stored by an older version (fewer keys) is read, so every reader has attributes and no defaults of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields

ORDER = ("collect", "synthesize", "sft", "rl", "evaluate", "register")


@dataclass(frozen=True)
class StageResult:
    """What a stage returns and Prefect caches: its MLflow run, its metrics, its outputs' content hashes.

    Pickled by Prefect's default result serializer: a field added later needs a default, so that results
    cached before it still load.
    """

    stage: str
    run_id: str  # "" when the stage was restored from DVC, not run
    metrics: dict = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)  # output path under the root -> content hash
    gate: GateReport | None = None  # evaluate: the gate report (data/<pipeline>/evaluate/gate.json)
    registration: dict | None = None  # register: the version and its aliases (registration.json)
    warnings: list[str] = field(default_factory=list)  # what the run's summary should say (synthesize: failed tasks)

    def __setstate__(self, state: dict) -> None:
        state = {"warnings": []} | state  # a result cached before stages had warnings
        # a result Prefect cached before the gate report was typed holds it as gate.json's dict
        if isinstance(state.get("gate"), Mapping):
            state = state | {"gate": GateReport.from_dict(state["gate"])}
        self.__dict__.update(state)


def _from_dict(cls, data: Mapping, what: str, remedy: str):
    """An instance of dataclass `cls` from its dict; fields with a default may be missing (older records)."""
    missing = [f.name for f in fields(cls) if f.name not in data
               and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise ValueError(f"{what} has no {', '.join(missing)}: it was not written by flywheel, or is damaged; "
                         f"{remedy}")
    return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


@dataclass(frozen=True)
class GateReport:
    """What the evaluate stage decided and measured: gate.json, the evaluate StageResult, what register tags.

    Its values are plain data kept as the stage computed them (records and numbers as pandas and the gate
    serialise them), so that to_dict through Catalog.write_json gives gate.json byte for byte as before.
    """

    passed: bool
    reasons: list[str]
    numbers: dict  # GateDecision's numbers: diff, candidate, null, base, cost, flags, slices...
    scores: dict[str, float]  # score_<label> -> greedy held-out mean reward (flywheel/metrics.py score_name)
    candidate_hash: str  # content hash of the RL checkpoint evaluated: register checks it is the one it registers
    champion_version: str | None = None  # the champion the candidate was judged against; None: no champion
    slice_scores: list[dict] = field(default_factory=list)  # per model and slice: score, pass rate, interval
    # reports written before the null policy, pass rates and references were measured have these empty
    refused: list[str] = field(default_factory=list)  # why the eval cannot measure the candidate (in reasons too)
    pass_rates: dict[str, float] = field(default_factory=dict)  # pass_rate_<label> -> greedy held-out pass rate
    models: list[dict] = field(default_factory=list)  # per model: mean reward, pass rate, interval, cost, tasks
    references: dict[str, dict] = field(default_factory=dict)  # name -> pass rate, cost, the candidate's shares
    user_errors: dict[str, int] = field(default_factory=dict)  # model label -> episodes the simulated user broke
    warnings: list[str] = field(default_factory=list)  # RL's word that it changed nothing

    @classmethod
    def from_dict(cls, data: Mapping) -> GateReport:
        """A report as gate.json holds it, from any version of the evaluate stage."""
        return _from_dict(cls, data, "the gate report", "run the evaluate stage again to write it")

    def to_dict(self) -> dict:
        """The report as gate.json holds it."""
        return {key: getattr(self, key) for key in _GATE_JSON_ORDER}


# the keys in the order the evaluate stage has always built them (gate.json sorts them; Prefect's artifact not)
_GATE_JSON_ORDER = ("passed", "reasons", "refused", "numbers", "scores", "pass_rates", "models", "references",
                    "user_errors", "warnings", "candidate_hash", "champion_version", "slice_scores")


@dataclass(frozen=True)
class RetrainSummary:
    """What a run of the retrain flow returns: the held-out scores and the gate, the version, what ran."""

    pipeline: str
    scores: dict[str, float]  # score_<label> -> greedy held-out mean reward
    gate_passed: bool
    gate_reasons: list[str]
    version: str  # the registered version of the candidate
    aliases: list[str]  # that version's aliases after the run
    champion: str | None  # the champion's version after the run; None: no champion
    ran: list[str]  # the stages run
    cached: list[str]  # the stages Prefect's cache answered
    # summaries of older versions lack these
    pass_rates: dict[str, float] = field(default_factory=dict)
    references: dict[str, dict] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # why the eval could not measure the candidate
    restored: list[str] = field(default_factory=list)  # the stages checked out from DVC, not run (a rerun)
    run_id: str = ""  # the pipeline's MLflow run
    student: str = ""  # which student trained, and why (`student.model: auto`)
    seconds: dict[str, float] = field(default_factory=dict)  # stage -> wall seconds this run took for it
    estimate: dict[str, float] = field(default_factory=dict)  # `flywheel check`'s estimate (estimate.<stage>_s)

    @classmethod
    def from_dict(cls, data: Mapping) -> RetrainSummary:
        """A summary as an older version of the retrain flow returned it (a dict)."""
        return _from_dict(cls, data, "the retrain summary", "run the pipeline again")

    def to_dict(self) -> dict:
        """The summary as a dict, in the order the retrain flow has always built it."""
        return {key: getattr(self, key) for key in _SUMMARY_ORDER}


_SUMMARY_ORDER = ("pipeline", "scores", "gate_passed", "gate_reasons", "version", "pass_rates", "references",
                  "warnings", "refused", "aliases", "champion", "ran", "restored", "cached", "run_id", "student",
                  "seconds", "estimate")
