"""The stages of a pipeline as plain data: their names in order, and what a stage returns.

Both sides read this: tasks/ (the stages themselves, run by Prefect) and the parts of flywheel/ that read what
the stages recorded (flywheel/status.py), which may not import tasks/. ORDER is the one list of the stages:
tasks/spec.py holds each one's inputs, config sections, code and outputs, keyed and ordered by it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    gate: dict | None = None  # evaluate: the gate report, as data/<pipeline>/evaluate/gate.json holds it
    registration: dict | None = None  # register: the version and its aliases (registration.json)
