"""The next scheduled retrain of a pipeline, from Prefect: deployment `retrain/<pipeline>` and its scheduled runs."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from flows.names import retrain_deployment
from flywheel.config import ScheduleConfig


@dataclass(frozen=True)
class NextRun:
    """When the pipeline retrains next (None when Prefect does not know), and a line saying how that is known."""

    when: datetime.datetime | None
    line: str


def next_run(pipeline: str, schedule: ScheduleConfig | None) -> NextRun:
    """The earliest scheduled flow run of the pipeline's deployment; its schedule's next date when none is
    created yet; or, with no Prefect API or no deployment, what pipelines.yaml says."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL

    name = retrain_deployment(pipeline)
    said = (f"pipelines.yaml says {schedule.cron} {schedule.timezone} (next: "
            f"{_show(_next_date(schedule.cron, schedule.timezone))})") if schedule else "pipelines.yaml has no schedule"
    api = PREFECT_API_URL.value() or "the embedded Prefect server"
    with get_client(sync_client=True) as client:
        error = client.api_healthcheck()
        if error is not None:
            return NextRun(None, f"no Prefect API reachable at {api} ({type(error).__name__}); {said}")
        try:
            deployment = client.read_deployment_by_name(name)
        except ObjectNotFound:
            return NextRun(None, f"not deployed (no deployment {name} on {api}); {said}")
        scheduled = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])),
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
                type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]))),
            sort=FlowRunSort.EXPECTED_START_TIME_ASC, limit=1)
    if scheduled:
        when = scheduled[0].expected_start_time
        return NextRun(when, f"{_show(when)} (flow run '{scheduled[0].name}' of deployment {name})")
    crons = [s.schedule for s in deployment.schedules if s.active and getattr(s.schedule, "cron", None)]
    if deployment.paused or not crons:
        return NextRun(None, f"deployment {name} is paused or has no active schedule; {said}")
    when = min(_next_date(s.cron, s.timezone or "UTC") for s in crons)
    return NextRun(when, f"{_show(when)} by the schedule of deployment {name} ({crons[0].cron} "
                         f"{crons[0].timezone or 'UTC'}; no run created yet: is a Prefect server's scheduler on?)")


def _next_date(cron: str, timezone: str) -> datetime.datetime:
    from prefect.server.schemas.schedules import CronSchedule
    from prefect.utilities.asyncutils import run_coro_as_sync

    return run_coro_as_sync(CronSchedule(cron=cron, timezone=timezone).get_dates(1))[0]


def _show(when: datetime.datetime) -> str:
    return when.astimezone(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
