"""Where a pipeline stands, from MLflow: champion and challenger, the last retrain runs, the data versions."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
from mlflow.exceptions import MlflowException

from flywheel.metrics import score_name
from flywheel.registry import client
from flywheel.stages import ORDER
from flywheel.tags import (
    DVC_PREFIX,
    PIPELINE_RUN_TAG,
    PROMOTION_TAG,
    REGISTERED_VERSION_TAG,
    RERUN_OF_TAG,
    STAGE_TAG,
    dvc_tag,
    gate_word,
    pass_rate_tag,
    score_tag,
    stage_state_tag,
)

ALIASES = ("champion", "challenger")


@dataclass(frozen=True)
class AliasState:
    """The version behind an alias: its held-out mean reward and pass rate, when it was registered and from which
    pipeline run."""

    alias: str
    version: str
    score: float | None  # the mean reward
    registered: pd.Timestamp
    pipeline_run: str
    gate: str  # passed, failed or refused
    promotion: str  # how it became champion: gate, forced, rollback; "" if it never did
    data: dict[str, str]  # dataset/model path -> DVC md5
    pass_rate: float | None = None


@dataclass(frozen=True)
class RunState:
    """One retrain run: when, how it ended, the gate, the version it registered, what ran."""

    run_id: str
    started: pd.Timestamp
    status: str
    gate: str
    version: str
    stages: dict[str, str]  # stage -> ran, cached or restored
    rerun_of: str
    data: dict[str, str]


@dataclass(frozen=True)
class PipelineStatus:
    pipeline: str
    aliases: list[AliasState]
    runs: list[RunState]

    def data_versions(self) -> pd.DataFrame:
        """One row per dataset or model: its md5 in the champion, the challenger and the newest run."""
        columns = {f"{a.alias} v{a.version}": a.data for a in self.aliases}
        if self.runs:
            columns[f"last run {self.runs[0].run_id[:8]}"] = self.runs[0].data
        paths = sorted({p for data in columns.values() for p in data})
        return pd.DataFrame([{"path": p, **{c: d.get(p, "") for c, d in columns.items()}} for p in paths])


def _data(tags: dict) -> dict[str, str]:
    return {k.removeprefix(DVC_PREFIX): v for k, v in tags.items()
            if k.startswith((dvc_tag("data/"), dvc_tag("models/")))}


def pipeline_status(pipeline: str, last: int = 5) -> PipelineStatus:
    """The registry's aliases of the pipeline's model and its last `last` retrain runs, newest first."""
    c = client()
    aliases = []
    for alias in ALIASES:
        try:
            mv = c.get_model_version_by_alias(pipeline, alias)
        except MlflowException:
            continue
        score, passed = mv.tags.get(score_tag(score_name("rl"))), mv.tags.get(pass_rate_tag("rl"))
        aliases.append(AliasState(alias, str(mv.version), float(score) if score else None,
                                  pd.Timestamp(mv.creation_timestamp, unit="ms", tz="UTC"),
                                  mv.tags.get(PIPELINE_RUN_TAG, mv.run_id or ""),
                                  gate_word(mv.tags), mv.tags.get(PROMOTION_TAG, ""),
                                  _data(mv.tags), float(passed) if passed else None))
    runs = []
    experiment = c.get_experiment_by_name(pipeline)
    if experiment is not None:
        for run in c.search_runs([experiment.experiment_id], f"tags.`{STAGE_TAG}` = 'retrain'",
                                 order_by=["attributes.start_time DESC"], max_results=last):
            tags = run.data.tags
            runs.append(RunState(run.info.run_id, pd.Timestamp(run.info.start_time, unit="ms", tz="UTC"),
                                 run.info.status, gate_word(tags),
                                 tags.get(REGISTERED_VERSION_TAG, ""),
                                 {s: tags[stage_state_tag(s)] for s in ORDER if stage_state_tag(s) in tags},
                                 tags.get(RERUN_OF_TAG, ""), _data(tags)))
    return PipelineStatus(pipeline, aliases, runs)
