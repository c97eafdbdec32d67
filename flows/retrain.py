"""The retrain flow: collect -> synthesize -> sft -> rl -> evaluate -> register, each stage cached by content."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from prefect import flow, runtime

from flows.concurrency import pipeline_slot
from flows.names import RETRAIN_FLOW
from flows.runlock import Holding, pipeline_lock, reap
from flows.stage import run_stage
from flywheel import registry
from flywheel.config import load_pipeline
from flywheel.data import dvc
from flywheel.metrics import STAGE_SECONDS
from flywheel.stages import ORDER, RetrainSummary, StageResult
from flywheel.tags import (
    FLOW_RUN_TAG,
    GATE_REFUSED_TAG,
    GIT_DIRTY_TAG,
    PIPELINE_RUN_TAG,
    REFRESH_TAG,
    REGISTERED_VERSION_TAG,
    gate_tag,
    stage_run_tag,
    stage_state_tag,
)
from flywheel.train.students import StudentChoice, resolve_student
from tasks.spec import output_hashes


@flow(name=RETRAIN_FLOW, log_prints=False)
def retrain(pipeline: str = "demo", root: str = ".", refresh: bool = False, push: bool = True,
            restored: list[str] | None = None, tags: dict[str, str] | None = None, promote: bool = True,
            stage_jobs: dict[str, dict] | None = None, wait: bool = False,
            estimate: dict[str, float] | None = None) -> RetrainSummary:
    """Run every stage of the pipeline; unchanged stages come from Prefect's cache and are not run again.

    `restored` stages are not run: their outputs were checked out from DVC (a rerun). `tags` go on the
    pipeline run and the registered version; `promote=False` registers without offering champion to the gate.
    `stage_jobs` (stage -> job variables) runs each stage as its own `stage/<pipeline>` flow run, i.e. its own
    job on the pool (a GPU only where a stage needs one); unset, every stage runs in this flow run.
    One run of a pipeline at a time per project folder (flows/runlock.py): another one running makes this one
    fail naming it, or, with `wait`, start when it ends. `flywheel run` takes that lock before the flow starts;
    the flow then runs under it (a deployment's run, with no command around it, takes it here).
    `estimate`: `flywheel check`'s estimated seconds per stage (Estimate.params), recorded as the run's params
    beside each stage's measured seconds (metrics), and both in the summary.
    """
    root_path = Path(root).resolve()
    cfg = load_pipeline(pipeline, root_path / "pipelines.yaml")  # a bad config fails here, before any work
    cfg, student = resolve_student(cfg, root_path)  # `student.model: auto` picked once, as every stage picks it
    if stage_jobs is not None and set(ORDER) - set(stage_jobs):
        raise ValueError(f"stage_jobs has no job variables for {sorted(set(ORDER) - set(stage_jobs))}: give "
                         "every stage its own ({} for the pool's defaults)")
    flow_run_id = str(runtime.flow_run.id or "")
    with pipeline_lock(root_path, pipeline, flow_run_id, wait) as holding, \
            pipeline_slot(pipeline, flow_run_id, wait):  # the file lock for this folder, the slot across machines
        for found in reap(root_path):  # runs of this project whose process died: stopped and marked as they ended
            if found.state == "dead":
                print(found.line(), flush=True)
        return _stages(pipeline, root_path, cfg, student, refresh, push, list(restored or []), tags, promote,
                       stage_jobs, flow_run_id, holding, estimate or {})


def _stages(pipeline: str, root_path: Path, cfg, student: StudentChoice, refresh: bool, push: bool,
            restored: list[str], tags: dict[str, str] | None, promote: bool, stage_jobs: dict[str, dict] | None,
            flow_run_id: str, holding: Holding, estimate: dict[str, float]) -> RetrainSummary:
    use_dvc = dvc.is_repo(root_path)
    parent = registry.start_run(root_path, pipeline, "retrain", tags={
        FLOW_RUN_TAG: flow_run_id, REFRESH_TAG: refresh, GIT_DIRTY_TAG: registry.git_dirty(root_path),
        **(tags or {})})
    holding.record(mlflow_run_id=parent.run_id)
    registry.record_config(parent, pipeline, cfg.model_dump(mode="json"))
    if estimate:
        parent.params(estimate)
    seconds: dict[str, float] = {}
    # what only some stages take: register is told whether to offer promotion, and the run it belongs to
    options = {"register": {"promote": promote, "lineage": {
        FLOW_RUN_TAG: flow_run_id, PIPELINE_RUN_TAG: parent.run_id, **(tags or {})}}}

    results: dict[str, StageResult] = {}
    ran: list[str] = []
    try:
        for number, name in enumerate(ORDER, start=1):
            started = time.monotonic()
            if name in restored:
                results[name] = StageResult(name, "", outputs=output_hashes(name, pipeline, root_path))
                parent.tags({stage_state_tag(name): "restored"})
                print(f"[{number}/{len(ORDER)}] {name} restored from DVC, not run", flush=True)
                continue
            kwargs = {"pipeline": pipeline, "root": str(root_path), "parent_run_id": parent.run_id,
                      **options.get(name, {})}
            jobs = stage_jobs[name] if stage_jobs is not None else None
            print(f"[{number}/{len(ORDER)}] {name} ...", flush=True)
            # the stage runs where its outputs go (here, or a job's own checkout), checks a cached result against
            # the outputs there, and is in dvc.lock after (flows/stage.py)
            result, cached = run_stage(name, kwargs, refresh, jobs, push)
            if not cached:
                ran.append(name)
            results[name] = result
            took = time.monotonic() - started
            seconds[name] = round(took, 1)
            parent.metrics({STAGE_SECONDS.format(stage=name): seconds[name]})
            parent.tags({stage_state_tag(name): "cached" if cached else "ran", stage_run_tag(name): result.run_id})
            print(f"[{number}/{len(ORDER)}] {name} {'cached' if cached else 'done'} in {took:.1f}s", flush=True)
        # the datasets and models the candidate came from (register tags its version with the same)
        parent.tags(dvc.lineage_tags(root_path, pipeline, ORDER[:-1]))
        if use_dvc and push and ran and stage_jobs is None:  # a stage job pushes its own outputs
            dvc.push(root_path)
        if use_dvc:
            registry.record_lock(parent, dvc.read_lock(root_path), pipeline)
    except BaseException as err:
        parent.end(ok=False, stopped=not isinstance(err, Exception))  # a signal: KILLED, as the flow run CRASHED
        raise
    summary = _summary(pipeline, results, ran, restored, parent.run_id, student.line())
    summary = replace(summary, seconds=seconds, estimate=estimate)
    parent.metrics(dict(summary.scores))
    parent.tags(gate_tag(summary.gate_passed) | {REGISTERED_VERSION_TAG: summary.version}
                | ({GATE_REFUSED_TAG: "; ".join(summary.refused)[:5000]} if summary.refused else {}))
    parent.end(ok=True)
    return summary


def _summary(pipeline: str, results: dict[str, StageResult], ran: list[str], restored: list[str], run_id: str,
             student: str) -> RetrainSummary:
    gate = results["evaluate"].gate
    registration = results["register"].registration
    current = registry.get_alias(pipeline, "champion")
    return RetrainSummary(
        pipeline=pipeline, scores=gate.scores, gate_passed=gate.passed, gate_reasons=gate.reasons,
        version=registration["version"], pass_rates=gate.pass_rates, references=gate.references,
        warnings=[w for name in ORDER if name in results for w in results[name].warnings] + gate.warnings,
        refused=gate.refused,
        aliases=sorted(registry.client().get_model_version(pipeline, registration["version"]).aliases),
        champion=current.version if current else None, ran=ran, restored=restored,
        cached=[n for n in ORDER if n not in ran and n not in restored], run_id=run_id, student=student)
