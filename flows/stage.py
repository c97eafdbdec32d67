"""One stage of a pipeline as its own flow run: how the retrain flow runs a stage, in-process or as a job.

`run_here` calls the stage's Prefect task in the current flow run (the default: the whole pipeline is one job).
`run_as_job` starts the `stage` flow on the pipeline's `stage/<pipeline>` deployment with that stage's job
variables (e.g. a GPU for sft, rl and evaluate only) and waits for it. The jobs share the project folder (a
volume mounted at the same path in every job), the Prefect result storage, MLflow and the DVC remote.
"""

from __future__ import annotations

from prefect import flow

from flows.names import STAGE_FLOW, stage_deployment
from flywheel.errors import UserFacingError
from flywheel.stages import StageResult
from tasks.kernel import stage_by_name


class StageJobError(UserFacingError, RuntimeError):
    """A stage to run as its own job has no deployment, or its job ended without completing; the message says
    which and what to do."""


def run_stage(name: str, kwargs: dict, refresh: bool, job_variables: dict | None) -> tuple[StageResult, bool]:
    """Run stage `name` in this flow run, or as its own job when it has `job_variables`: (result, cached)."""
    if job_variables is None:
        return run_here(name, kwargs, refresh)
    return run_as_job(name, kwargs, refresh, job_variables)


def run_here(name: str, kwargs: dict, refresh: bool = False) -> tuple[StageResult, bool]:
    """Run stage `name`'s Prefect task in this flow run: (its result, whether it came from the cache)."""
    stage_task = stage_by_name(name)
    if refresh:
        stage_task = stage_task.with_options(refresh_cache=True)
    state = stage_task(**kwargs, return_state=True)
    return state.result(), state.name == "Cached"  # result() raises the stage's own error if it failed


@flow(name=STAGE_FLOW, persist_result=True, log_prints=False)
def stage(name: str, pipeline: str, root: str, kwargs: dict | None = None, refresh: bool = False) -> dict:
    """Run one stage of the pipeline (its cached Prefect task) in this flow run; `kwargs` go to it as well."""
    result, cached = run_here(name, {"pipeline": pipeline, "root": root, **(kwargs or {})}, refresh)
    return {"result": result, "cached": cached}


def run_as_job(name: str, kwargs: dict, refresh: bool, job_variables: dict) -> tuple[StageResult, bool]:
    """Run stage `name` as a `stage/<pipeline>` flow run with `job_variables`, wait: (result, cached)."""
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    pipeline = kwargs["pipeline"]
    others = {k: v for k, v in kwargs.items() if k not in ("pipeline", "root")}
    deployment = stage_deployment(pipeline)
    try:
        flow_run = run_deployment(deployment, parameters={"name": name, "pipeline": pipeline, "root": kwargs["root"],
                                                          "kwargs": others, "refresh": refresh},
                                  job_variables=job_variables, flow_run_name=f"{pipeline}-{name}",
                                  timeout=None, poll_interval=2)
    except ObjectNotFound:
        raise StageJobError(f"stage {name} should run as its own job, but there is no deployment '{deployment}': "
                           "deploy it with `flywheel deploy --pool POOL --job-per-stage`") from None
    if not flow_run.state.is_completed():
        raise StageJobError(f"stage {name} ran as flow run '{flow_run.name}' ({flow_run.id}), which ended "
                           f"{flow_run.state.name}: {flow_run.state.message}")
    outcome = flow_run.state.result()
    return outcome["result"], outcome["cached"]
