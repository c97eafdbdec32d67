"""The retrain flow: collect -> synthesize -> sft -> rl -> evaluate -> register, each stage cached by content."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow, runtime

from flows.stage import STAGE_TASKS, run_as_job, run_here
from flywheel import registry
from flywheel.config import load_pipeline
from flywheel.data import dvc
from tasks.spec import ORDER, STAGES, output_hashes

__all__ = ["STAGE_TASKS", "retrain"]  # STAGE_TASKS: `flywheel stage` finds the stages here


@flow(name="retrain", log_prints=False)
def retrain(pipeline: str = "demo", root: str = ".", refresh: bool = False, push: bool = True,
            restored: list[str] | None = None, tags: dict[str, str] | None = None, promote: bool = True,
            stage_jobs: dict[str, dict] | None = None) -> dict:
    """Run every stage of the pipeline; unchanged stages come from Prefect's cache and are not run again.

    `restored` stages are not run: their outputs were checked out from DVC (a rerun). `tags` go on the
    pipeline run and the registered version; `promote=False` registers without offering champion to the gate.
    `stage_jobs` (stage -> job variables) runs each stage as its own `stage/<pipeline>` flow run, i.e. its own
    job on the pool (a GPU only where a stage needs one); unset, every stage runs in this flow run.
    """
    root_path = Path(root).resolve()
    cfg = load_pipeline(pipeline, root_path / "pipelines.yaml")  # a bad config fails here, before any work
    if stage_jobs is not None and set(ORDER) - set(stage_jobs):
        raise ValueError(f"stage_jobs has no job variables for {sorted(set(ORDER) - set(stage_jobs))}: give "
                         "every stage its own ({} for the pool's defaults)")
    use_dvc = dvc.is_repo(root_path)
    flow_run_id = str(runtime.flow_run.id or "")
    restored = list(restored or [])
    parent = registry.start_run(root_path, pipeline, "retrain", tags={
        "prefect.flow_run_id": flow_run_id, "flywheel.refresh": refresh,
        "git.dirty": registry.git_dirty(root_path), **(tags or {})})
    registry.record_config(parent, pipeline, cfg.model_dump(mode="json"))

    def run_stage(name: str, kwargs: dict, refresh_cache: bool) -> tuple[dict, bool]:
        if stage_jobs is None:
            return run_here(name, kwargs, refresh_cache)
        return run_as_job(name, kwargs, refresh_cache, job_variables=stage_jobs[name])

    results: dict[str, dict] = {}
    ran: list[str] = []
    try:
        for number, name in enumerate(ORDER, start=1):
            started = time.monotonic()
            if name in restored:
                results[name] = {"stage": name, "run_id": "", "outputs": output_hashes(name, pipeline, root_path)}
                parent.tags({f"stage.{name}": "restored"})
                print(f"[{number}/{len(ORDER)}] {name} restored from DVC, not run", flush=True)
                continue
            outputs_missing = not all(p.exists() for p in STAGES[name].out_paths(root_path, pipeline))
            kwargs = {"pipeline": pipeline, "root": str(root_path), "parent_run_id": parent.run_id}
            if name == "register":
                kwargs["promote"] = promote
                kwargs["lineage"] = {"prefect.flow_run_id": flow_run_id, "mlflow.pipeline_run_id": parent.run_id,
                                     **_data_lineage(root_path, pipeline), **(tags or {})}
                parent.tags({k: v for k, v in kwargs["lineage"].items() if k.startswith("flywheel.dvc.")})
            print(f"[{number}/{len(ORDER)}] {name} ...", flush=True)
            result, cached = run_stage(name, kwargs, refresh_cache=refresh or outputs_missing)
            if cached and result["outputs"] != output_hashes(name, pipeline, root_path):
                # the cache is right about the inputs, but the workspace holds other outputs (another config's
                # run, a manual edit): make them again rather than hand stale files downstream
                print(f"[{number}/{len(ORDER)}] {name}: outputs on disk differ from the cached run's; rerunning")
                result, cached = run_stage(name, kwargs, refresh_cache=True)
            if use_dvc and (not cached or not dvc.lock_hashes(root_path, name, pipeline)):
                dvc.commit(root_path, name, pipeline)
            if not cached:
                ran.append(name)
            results[name] = result
            took = time.monotonic() - started
            parent.tags({f"stage.{name}": "cached" if cached else "ran", f"stage.{name}.run_id": result["run_id"]})
            print(f"[{number}/{len(ORDER)}] {name} {'cached' if cached else 'done'} in {took:.1f}s", flush=True)
        if use_dvc and push and ran:
            dvc.push(root_path)
        if use_dvc:
            registry.record_lock(parent, root_path, pipeline)
    except BaseException:
        parent.end(ok=False)
        raise
    summary = _summary(pipeline, results, ran, restored) | {"run_id": parent.run_id}
    parent.metrics({k: v for k, v in summary["scores"].items()})
    parent.tags({"flywheel.gate": "passed" if summary["gate_passed"] else "failed",
                 "flywheel.registered_version": summary["version"]})
    parent.end(ok=True)
    return summary


def _data_lineage(root: Path, pipeline: str) -> dict:
    """DVC md5 of every dataset and model the candidate came from, as dvc.lock records them."""
    hashes = {}
    for name in ORDER[:-1]:
        hashes |= dvc.lock_hashes(root, name, pipeline)
    return {f"flywheel.dvc.{path}": md5 for path, md5 in sorted(hashes.items()) if md5}


def _summary(pipeline: str, results: dict, ran: list[str], restored: list[str]) -> dict:
    gate = results["evaluate"]["gate"]
    registration = results["register"]["registration"]
    current = registry.get_alias(pipeline, "champion")
    return {"pipeline": pipeline, "scores": gate["scores"], "gate_passed": gate["passed"],
            "gate_reasons": gate["reasons"], "version": registration["version"],
            "aliases": sorted(registry.client().get_model_version(pipeline, registration["version"]).aliases),
            "champion": current.version if current else None, "ran": ran, "restored": restored,
            "cached": [n for n in ORDER if n not in ran and n not in restored]}
