"""One stage of a pipeline as its own flow run: how the retrain flow runs a stage, in-process or as a job.

`run_here` calls the stage's Prefect task in the current flow run (the default: the whole pipeline is one job).
`run_as_job` starts the `stage` flow on the pipeline's `stage/<pipeline>` deployment with that stage's job
variables (e.g. a GPU for sft, rl and evaluate only; `work_queue` picks the pool's queue, hence the workers that
may take it) and waits for it.

A stage job needs no folder in common with the retrain flow that started it, nor with the other stage jobs: it
runs in the project checkout of the machine its worker is on (the deployments' root: the same path on every
machine, each its own folder). What passes between them:
- dvc.lock entries: the retrain flow hands the job its entries of the pipeline's stages; the job writes them into
  its checkout's dvc.lock and pulls from the DVC remote the outputs of the stages it reads from (and its own, which
  a cached stage must find: `run_here` reruns a cached stage whose outputs are missing or differ), runs the stage,
  commits it as `dvc repro` would, pushes its outputs and hands back its new entry, which the retrain flow writes
  into its own dvc.lock without the files;
- the stage's result (StageResult), through Prefect's result storage (shared: `flywheel deploy --results s3://`);
- MLflow runs and registered versions, on the MLflow server; models are DVC outputs, so they move as data does.
In one shared folder (a ReadWriteMany volume, one machine) the same steps run and the pulls find everything there.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow

from flows.names import STAGE_FLOW, stage_deployment
from flywheel.data import dvc
from flywheel.errors import UserFacingError
from flywheel.stages import ORDER, StageResult
from tasks.kernel import stage_by_name
from tasks.spec import STAGES, output_hashes

QUEUE = "work_queue"  # in a stage's job variables: the work queue its flow run goes to, not a job variable


class StageJobError(UserFacingError, RuntimeError):
    """A stage to run as its own job has no deployment, cannot get its inputs, or its job ended without completing;
    the message says which and what to do."""


def run_stage(name: str, kwargs: dict, refresh: bool, job_variables: dict | None,
              push: bool = True) -> tuple[StageResult, bool]:
    """Run stage `name` in this flow run, or as its own job when it has `job_variables`: (result, cached).

    Either way the stage is in dvc.lock afterwards (committed here, or committed by the job and recorded here);
    a job pushes its outputs to the DVC remote unless `push` is off."""
    if job_variables is not None:
        return run_as_job(name, kwargs, refresh, job_variables, push)
    result, cached = run_here(name, kwargs, refresh)
    root, pipeline = Path(kwargs["root"]).resolve(), kwargs["pipeline"]
    if dvc.is_repo(root) and (not cached or not dvc.lock_hashes(root, name, pipeline)):
        dvc.commit(root, name, pipeline)
    return result, cached


def run_here(name: str, kwargs: dict, refresh: bool = False) -> tuple[StageResult, bool]:
    """Run stage `name`'s Prefect task in this flow run: (its result, whether it came from the cache).

    A cached result counts only where its outputs are: the stage runs if the folder lacks one of them, and again
    if they differ from the cached run's (another config's run, a manual edit): no stale files handed on."""
    root, pipeline = Path(kwargs["root"]).resolve(), kwargs["pipeline"]
    missing = not all(p.exists() for p in STAGES[name].out_paths(root, pipeline))
    result, cached = _task(name, kwargs, refresh or missing)
    if cached and result.outputs != output_hashes(name, pipeline, root):
        print(f"{name}: the outputs in {root} differ from the cached run's; running it again", flush=True)
        result, cached = _task(name, kwargs, True)
    return result, cached


def _task(name: str, kwargs: dict, refresh: bool) -> tuple[StageResult, bool]:
    stage_task = stage_by_name(name)
    if refresh:
        stage_task = stage_task.with_options(refresh_cache=True)
    state = stage_task(**kwargs, return_state=True)
    return state.result(), state.name == "Cached"  # result() raises the stage's own error if it failed


@flow(name=STAGE_FLOW, persist_result=True, log_prints=False)
def stage(name: str, pipeline: str, root: str, kwargs: dict | None = None, refresh: bool = False,
          lock_entries: dict[str, dict] | None = None, push: bool = True) -> dict:
    """Run one stage of the pipeline in the project checkout at `root` on this machine: its inputs pulled as the
    retrain flow's `lock_entries` (its dvc.lock entries) record them, its cached Prefect task (`kwargs` go to it),
    then commit and push; its result, whether it was cached, and its new dvc.lock entry."""
    root_path = Path(root).resolve()
    stage_kwargs = {"pipeline": pipeline, "root": root, **(kwargs or {})}
    if not dvc.is_repo(root_path):  # nothing to pull or push: the folder must be the retrain flow's own
        result, cached = run_here(name, stage_kwargs, refresh)
        return {"result": result, "cached": cached, "lock": None}
    started = time.monotonic()
    pull_inputs(name, pipeline, root_path, lock_entries or {})
    pulled = time.monotonic()
    result, cached = run_here(name, stage_kwargs, refresh)
    ran = time.monotonic()
    dvc.commit(root_path, name, pipeline)  # always: the entry handed back must describe what is here now
    if push:
        dvc.push(root_path, name, pipeline)
    print(f"{name} in {root_path}: pulled in {pulled - started:.1f}s, {'cached' if cached else 'ran'} in "
          f"{ran - pulled:.1f}s, committed{' and pushed' if push else ''} in {time.monotonic() - ran:.1f}s",
          flush=True)
    return {"result": result, "cached": cached, "lock": dvc.read_lock(root_path)[f"{name}@{pipeline}"]}


def upstream(name: str) -> list[str]:
    """The stages whose outputs stage `name` reads (tasks/spec.py), in order."""
    reads = set(STAGES[name].deps)
    return [other for other in ORDER if reads & set(STAGES[other].outs)]


def pull_inputs(name: str, pipeline: str, root: Path, entries: dict[str, dict]) -> None:
    """Record the retrain flow's dvc.lock `entries` here and pull what they name of stage `name`'s inputs, and its
    own last outputs (best effort: where they cannot be pulled, run_here runs the stage). One DVC call when all
    can be pulled."""
    if not entries:
        return  # started by hand, not by a retrain flow: the folder holds what it holds
    dvc.record(root, entries)
    inputs = [other for other in upstream(name) if f"{other}@{pipeline}" in entries]
    wanted = inputs + ([name] if f"{name}@{pipeline}" in entries else [])
    if not wanted:
        return
    try:
        dvc.pull(root, wanted[0], pipeline, *wanted[1:])
        return
    except dvc.DvcError as err:
        missed = err
    if inputs:  # which was it: the inputs, or only the stage's own last outputs?
        try:
            dvc.pull(root, inputs[0], pipeline, *inputs[1:])
        except dvc.DvcError as err:
            raise StageJobError(
                f"stage {name} of {pipeline} runs in {root}, which lacks its inputs (the outputs of "
                f"{', '.join(inputs)}), and DVC could not pull them: {err}. Stage jobs that share no folder need a "
                "DVC remote every worker reaches (`dvc remote add -d`, committed) and runs that push") from None
    print(f"{name}: its last outputs could not be pulled into {root} ({missed}); it runs unless they are here",
          flush=True)


def run_as_job(name: str, kwargs: dict, refresh: bool, job_variables: dict,
               push: bool = True) -> tuple[StageResult, bool]:
    """Run stage `name` as a `stage/<pipeline>` flow run with `job_variables`, wait, record its dvc.lock entry
    in this folder's: (result, cached)."""
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    pipeline, root = kwargs["pipeline"], Path(kwargs["root"]).resolve()
    others = {k: v for k, v in kwargs.items() if k not in ("pipeline", "root")}
    variables = {k: v for k, v in job_variables.items() if k != QUEUE}
    deployment = stage_deployment(pipeline)
    try:
        flow_run = run_deployment(deployment, parameters={"name": name, "pipeline": pipeline, "root": str(root),
                                                          "kwargs": others, "refresh": refresh,
                                                          "lock_entries": handed(root, pipeline), "push": push},
                                  job_variables=variables, work_queue_name=job_variables.get(QUEUE),
                                  flow_run_name=f"{pipeline}-{name}", timeout=None, poll_interval=2)
    except ObjectNotFound:
        raise StageJobError(f"stage {name} should run as its own job, but there is no deployment '{deployment}': "
                           "deploy it with `flywheel deploy --pool POOL --job-per-stage`") from None
    if not flow_run.state.is_completed():
        raise StageJobError(f"stage {name} ran as flow run '{flow_run.name}' ({flow_run.id}), which ended "
                           f"{flow_run.state.name}: {flow_run.state.message}")
    return received(root, name, pipeline, flow_run.state.result())


def handed(root: Path, pipeline: str) -> dict[str, dict]:
    """What the retrain flow hands a stage job: its dvc.lock entries of the pipeline's stages."""
    return dvc.pipeline_entries(root, pipeline) if dvc.is_repo(root) else {}


def received(root: Path, name: str, pipeline: str, outcome: dict) -> tuple[StageResult, bool]:
    """What a stage job handed back (the `stage` flow's return), its dvc.lock entry recorded here, without the
    files: (result, cached)."""
    if outcome.get("lock") is not None and dvc.is_repo(root):
        dvc.record(root, {f"{name}@{pipeline}": outcome["lock"]})
    return outcome["result"], outcome["cached"]
