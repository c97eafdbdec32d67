"""Stage register: the candidate becomes a version of the registered model; `champion` moves only on a pass."""

from __future__ import annotations

import hashlib

import mlflow

from flywheel import promotion, registry
from flywheel.checkpoints import adapter_base
from flywheel.data import dvc
from flywheel.data.catalog import content_hash
from flywheel.evaluate import summary
from flywheel.evaluate.gate import GateDecision
from flywheel.evaluate.report import reference_line
from flywheel.metrics import PASS_RATE
from flywheel.serving.chat import input_example
from flywheel.serving.mlflow_model import StudentChatModel
from flywheel.stages import ORDER, GateReport, StageResult
from flywheel.tags import (
    ADAPTER_BASE_TAG,
    CONFIG_HASH_TAG,
    DVC_PREFIX,
    GATE_CHAMPION_TAG,
    GATE_REASONS_TAG,
    GATE_REFUSED_TAG,
    GIT_COMMIT_TAG,
    REGISTERED_VERSION_TAG,
    REWARD_HACKING_REASON_TAG,
    REWARD_HACKING_TAG,
    RL_NO_UPDATES_TAG,
    dvc_tag,
    gate_diff_tag,
    gate_tag,
    pass_rate_tag,
    reference_tag,
    score_tag,
    stage_run_tag,
)
from tasks.caching import by_content
from tasks.kernel import stage_context, stage_task
from tasks.reports import images, publish_model_report

_by_content = by_content("register")
SUMMARY_FILE = "summary.md"  # the register run's artifact: the version's description, with the plots


def cache_key(context, parameters: dict) -> str:
    """By content and by registry: a registration that was not offered for promotion is not one that was, and a
    version registered in one MLflow (the embedded SQLite store) is not one in another (a team's server)."""
    registry_id = hashlib.sha256(mlflow.get_tracking_uri().encode()).hexdigest()[:12]
    return (_by_content(context, parameters) + ("" if parameters.get("promote", True) else "-no-promote")
            + f"-registry-{registry_id}")


@stage_task(cache_key_fn=cache_key, retries=2, retry_delay_seconds=2)
def register(pipeline: str, root: str = ".", parent_run_id: str | None = None,
             lineage: dict | None = None, promote: bool = True) -> StageResult:
    """Register the RL checkpoint (idempotent on its content hash), alias it, tag its lineage.

    `promote=False` (a rerun) leaves champion where it is: the gate decision is recorded, not acted on.
    """
    with stage_context("register", pipeline, root, parent_run_id) as stage:
        cfg, catalog, root_path, run = stage.cfg, stage.catalog, stage.root, stage.run
        gate = GateReport.from_dict(catalog.read_json("evaluate", "gate.json"))
        run.params({"gate_passed": gate.passed})
        model_dir = catalog.model_dir("rl")
        model_hash = content_hash([model_dir], root_path)
        if model_hash != gate.candidate_hash:
            raise RuntimeError(f"{model_dir} changed since it was evaluated (hash {model_hash}, evaluated "
                               f"{gate.candidate_hash}); rerun the evaluate stage")
        tags = {**gate_tag(gate.passed),
                CONFIG_HASH_TAG: cfg.section_hash(*cfg.model_dump().keys()),
                GIT_COMMIT_TAG: registry.git_commit(root_path),
                **{score_tag(k): round(v, 4) for k, v in gate.scores.items()},
                **_data_tags(root_path, pipeline),
                **(lineage or {})}
        if adapter_base(model_dir):  # a LoRA adapter: serving needs the base it was trained over
            tags[ADAPTER_BASE_TAG] = adapter_base(model_dir)
        flags = gate.numbers.get("flags") or []
        tags |= {REWARD_HACKING_TAG: "flagged" if flags else "clean"} | (
            {REWARD_HACKING_REASON_TAG: "; ".join(flags)[:5000]} if flags else {})
        tags |= {GATE_REASONS_TAG: "; ".join(gate.reasons)[:5000],
                 GATE_CHAMPION_TAG: gate.champion_version or "none",
                 **{gate_diff_tag(k): round(v, 4) for k, v in (gate.numbers.get("diff") or {}).items()
                    if isinstance(v, float)}}
        tags |= _measured_tags(gate)
        version = registry.register(run, pipeline, model_dir, model_hash, tags, ["challenger"],
                                    eval_table=catalog.table_path("eval"), python_model=StudentChatModel(),
                                    example=input_example(stage.env))
        # compare-and-set: the gate was taken against the champion of evaluate time; if another run moved
        # champion since, the stored eval tables are gated again against the new one
        if promote:
            outcome = promotion.promote(pipeline, version.version, cfg.gate,
                                        decision=GateDecision(gate.passed, list(gate.reasons), gate.numbers,
                                                              list(gate.refused)),
                                        judged_against=gate.champion_version,
                                        reevaluate=lambda v, c: promotion.evaluate_now(pipeline, v, c, root_path, cfg))
            promoted, reasons = outcome.promoted, outcome.reasons
        else:
            promoted, reasons = False, ["not offered for promotion (a rerun: `flywheel rerun --promote` offers it)"]
        version = registry.get_version(pipeline, version.version)
        champion = registry.get_alias(pipeline, "champion")
        _describe(pipeline, gate, summary.Registration(version.version, sorted(version.aliases), promoted, reasons,
                                                       champion.version if champion else None),
                  {k.removeprefix(DVC_PREFIX): v for k, v in tags.items() if k.startswith(DVC_PREFIX)},
                  run, parent_run_id)
        result = {"version": version.version, "aliases": list(version.aliases), "model_hash": model_hash,
                  "gate_passed": gate.passed, "promoted": promoted, "promotion_reasons": reasons}
        catalog.write_json("register", "registration.json", result)
        run.tags({REGISTERED_VERSION_TAG: version.version})
        return stage.done({}, registration=result)


def _describe(pipeline: str, gate: GateReport, registration: summary.Registration, data: dict[str, str],
              run: registry.Run, parent_run_id: str | None) -> None:
    """The summary (flywheel/evaluate/summary.py) as the version's description, the register run's artifact and
    the Prefect artifact `<pipeline>-model`. In MLflow's UI the run links are relative, so they open in the UI
    showing the page; Prefect's artifact has the plots, and the run ids as text (a relative link there is
    Prefect's)."""
    runs = _runs(parent_run_id, run.run_id)
    experiment = registry.client().get_run(run.run_id).info.experiment_id
    registry.describe(pipeline, registration.version,
                      summary.render(pipeline, gate, registration, data, summary.Links(experiment, runs)))
    report = summary.render(pipeline, gate, registration, data, summary.Links("", runs), images(pipeline, gate, runs))
    run.text(report, SUMMARY_FILE)
    publish_model_report(pipeline, report)


def _data_tags(root, pipeline: str) -> dict[str, str]:
    """The md5 of every dataset and model the candidate came from (data/ and models/), as dvc.lock records them.

    The code each stage ran is the version's git commit and config hash; dvc.lock, every entry of it, is the
    pipeline run's artifact (registry.RECORD_LOCK)."""
    every = dvc.lineage_tags(root, pipeline, ORDER[:ORDER.index("register")])
    return {k: v for k, v in every.items() if k.startswith((dvc_tag("data/"), dvc_tag("models/")))}


def _runs(parent_run_id: str | None, register_run_id: str) -> dict[str, str]:
    """The MLflow runs behind the version: the pipeline run and its stage runs so far, this one last."""
    runs = {}
    if parent_run_id:
        tags = registry.client().get_run(parent_run_id).data.tags
        runs["pipeline"] = parent_run_id
        runs |= {name: tags[stage_run_tag(name)] for name in ORDER if tags.get(stage_run_tag(name))}
    return runs | {"register": register_run_id}


def _measured_tags(gate: GateReport) -> dict:
    """Pass rates beside the mean rewards, why the gate could not measure (if so), the references' shares, and
    RL's word that it changed nothing: what the version's tags must say for its scores to be read right."""
    tags = {pass_rate_tag(k.removeprefix(PASS_RATE)): round(v, 4) for k, v in gate.pass_rates.items()}
    if gate.refused:
        tags[GATE_REFUSED_TAG] = "; ".join(gate.refused)[:5000]
    for name, ref in gate.references.items():
        tags[reference_tag(name)] = reference_line(name, ref)[:5000]
        tags |= {reference_tag(name, k): round(ref[k], 6) if isinstance(ref[k], float) else ref[k]
                 for k in ("pass_rate", "pass_share", "cost_per_task_usd", "cost_share", "unanswered")
                 if ref.get(k) is not None}
    if gate.warnings:
        tags[RL_NO_UPDATES_TAG] = "; ".join(gate.warnings)[:5000]
    return tags
