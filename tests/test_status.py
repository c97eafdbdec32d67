"""`flywheel status`: the next scheduled run from Prefect (a real test server), or what pipelines.yaml says.

The MLflow side (aliases, runs, data versions) is checked against a real pipeline run in tests/test_rerun.py.
"""

from __future__ import annotations

import datetime
import socket
import uuid

from flywheel.config import ScheduleConfig

MONDAYS_AT_3 = ScheduleConfig(cron="0 3 * * 1", timezone="UTC")


def _next_monday_3am(now: datetime.datetime) -> datetime.datetime:
    day = (now + datetime.timedelta(days=(0 - now.weekday()) % 7)).replace(hour=3, minute=0, second=0, microsecond=0)
    return day if day > now else day + datetime.timedelta(days=7)


def _deploy(pipeline: str, schedule: ScheduleConfig):
    from prefect import get_client
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.schedules import CronSchedule

    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name("retrain")
        cron = CronSchedule(cron=schedule.cron, timezone=schedule.timezone)
        return client.create_deployment(flow_id, pipeline, schedules=[DeploymentScheduleCreate(schedule=cron,
                                                                                                active=True)])


def test_next_run_comes_from_the_deployment_and_its_scheduled_runs(prefect_server):
    from prefect import get_client
    from prefect.states import Scheduled

    from flows.status import next_run

    pipeline = f"p{uuid.uuid4().hex[:8]}"
    now = datetime.datetime.now(datetime.UTC)
    deployment_id = _deploy(pipeline, MONDAYS_AT_3)
    found = next_run(pipeline, MONDAYS_AT_3)
    assert found.when == _next_monday_3am(now), found.line
    assert f"retrain/{pipeline}" in found.line

    # a run someone scheduled sooner (e.g. the trace sensor) is the next one
    sooner = now + (found.when - now) / 2
    with get_client(sync_client=True) as client:
        client.create_flow_run_from_deployment(deployment_id, state=Scheduled(scheduled_time=sooner))
    found = next_run(pipeline, MONDAYS_AT_3)
    assert abs(found.when - sooner) < datetime.timedelta(seconds=1), found.line
    assert "flow run" in found.line


def test_without_a_deployment_or_an_api_status_says_what_pipelines_yaml_says(prefect_server):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.status import next_run

    found = next_run("never-deployed", MONDAYS_AT_3)
    assert found.when is None
    assert "not deployed" in found.line and "pipelines.yaml says 0 3 * * 1 UTC" in found.line
    assert _next_monday_3am(datetime.datetime.now(datetime.UTC)).strftime("%Y-%m-%d 03:00 UTC") in found.line

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}/api"
    with temporary_settings({PREFECT_API_URL: dead}):
        found = next_run("demo", None)
    assert found.when is None
    assert f"no Prefect API reachable at {dead}" in found.line and "pipelines.yaml has no schedule" in found.line


def test_status_of_a_pipeline_that_never_ran(project, prefect_server):
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound
    from typer.testing import CliRunner

    from flywheel.cli import app

    with get_client(sync_client=True) as client:  # the session's server may hold one from another test
        try:
            client.delete_deployment(client.read_deployment_by_name("retrain/small").id)
        except ObjectNotFound:
            pass
    shown = CliRunner().invoke(app, ["status", "small", "--root", str(project)])
    assert shown.exit_code == 0, shown.output
    assert "no registered version yet" in shown.output and "no retrain runs yet" in shown.output
    assert "not deployed" in shown.output
    refused = CliRunner().invoke(app, ["status", "nope", "--root", str(project)])
    assert refused.exit_code == 2 and "no pipeline named 'nope'" in refused.output
