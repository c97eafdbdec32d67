"""The trigger sensor: start `retrain/<pipeline>` once `trigger.min_new_traces` new trace records have arrived.

A light flow, run every `trigger.every_s` by its deployment `watch-traces/<pipeline>`: it counts the records
newer than the collect stage's watermarks (sizes, listings and trace metadata; see flywheel/data/arrivals.py)
and starts the retrain deployment, without waiting for it. While a retrain it started is still scheduled, or
any retrain of the pipeline is pending or running, it starts none: that run's collect takes the new records.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger

from flows.names import SENSOR_FLOW, retrain_deployment
from flywheel.config import load_pipeline
from flywheel.data.arrivals import count_new, saved_watermarks
from flywheel.tags import TRIGGER_TAG


@flow(name=SENSOR_FLOW, log_prints=False)
def watch_traces(pipeline: str = "demo", root: str = ".") -> dict:
    """Count the new trace records; start the retrain deployment if there are enough and none is on its way."""
    logger = get_run_logger()
    root_path = Path(root).resolve()
    cfg = load_pipeline(pipeline, root_path / "pipelines.yaml")
    decision = {"pipeline": pipeline, "new": 0, "by_source": {}, "started": None, "waiting_on": None}
    if cfg.trigger is None:
        logger.warning("pipelines.%s has no `trigger`: nothing to watch", pipeline)
        return decision
    decision["min_new_traces"] = cfg.trigger.min_new_traces
    decision["by_source"] = count_new(cfg.collect, root_path, saved_watermarks(root_path, pipeline))
    decision["new"] = sum(decision["by_source"].values())
    if decision["new"] < cfg.trigger.min_new_traces:
        logger.info("%s: %d new trace records, fewer than min_new_traces %d", pipeline, decision["new"],
                    cfg.trigger.min_new_traces)
        return decision
    on_its_way = active_retrain(pipeline)
    if on_its_way:
        decision["waiting_on"] = on_its_way
        logger.info("%s: %d new trace records; retrain flow run %s is already on its way", pipeline,
                    decision["new"], on_its_way)
        return decision
    from prefect.deployments import run_deployment

    run = run_deployment(retrain_deployment(pipeline), timeout=0, as_subflow=False, tags=[TRIGGER_TAG],
                         flow_run_name=f"{pipeline}-{decision['new']}-new-traces")
    decision["started"] = str(run.id)
    logger.info("%s: %d new trace records (>= %d): started %s flow run %s", pipeline, decision["new"],
                cfg.trigger.min_new_traces, retrain_deployment(pipeline), run.id)
    return decision


def active_retrain(pipeline: str) -> str | None:
    """A retrain of the pipeline that will collect the new records: one this sensor scheduled, or one running."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterDeploymentId,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            deployment = client.read_deployment_by_name(retrain_deployment(pipeline))
        except ObjectNotFound:
            raise RuntimeError(f"{retrain_deployment(pipeline)} is not deployed on {client.api_url}: run `flywheel "
                               "deploy --pool NAME` (or `flywheel serve`) for the sensor to start it") from None
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            deployment_id=FlowRunFilterDeploymentId(any_=[deployment.id]),
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[
                StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.PAUSED]))))
    for run in runs:
        # the schedule's own future runs are not on their way with these records; a started one is
        if run.state_type != StateType.SCHEDULED or TRIGGER_TAG in (run.tags or []):
            return str(run.id)
    return None
