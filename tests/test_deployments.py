"""Schedules and triggers in pipelines.yaml become deployments; a redeploy leaves exactly what the file says."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from conftest import REPO, SMALL_PIPELINE

POOL = "reconcile-pool"


def _write(root: Path, pipelines: dict) -> None:
    """The small pipeline under each name, with the given schedule/trigger keys added."""
    small = yaml.safe_load(SMALL_PIPELINE)["pipelines"]["small"]
    (root / "pipelines.yaml").write_text(yaml.safe_dump({"pipelines": {n: {**small, **extra}
                                                                       for n, extra in pipelines.items()}}))


def _state(pool: str | None) -> dict:
    """full name -> sorted schedule descriptions, of the flywheel deployments on the server (in that pool)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterTags

    from flows.deployments import TAG, _describe

    with get_client(sync_client=True) as client:
        flows = {f.id: f.name for f in client.read_flows()}
        found = client.read_deployments(deployment_filter=DeploymentFilter(tags=DeploymentFilterTags(all_=[TAG])))
        return {f"{flows[d.flow_id]}/{d.name}": sorted(_describe(s.schedule) for s in
                                                       client.read_deployment_schedules(d.id))
                for d in found if d.work_pool_name == pool}


def test_schedule_and_trigger_errors_name_the_key(tmp_path):
    from flywheel.config import ConfigError, load_pipelines

    cases = {"schedule: {cron: '0 3 * *'}": "pipelines.p.schedule",
             "schedule: {cron: '0 3 * * 1', timezone: Mars/Olympus}": "not an IANA time zone",
             "trigger: {min_new_traces: 0}": "pipelines.p.trigger.min_new_traces",
             "trigger: {min_new_traces: 5, every: 60}": "p.trigger.every: unknown key; did you mean 'every_s'"}
    for text, expected in cases.items():
        small = SMALL_PIPELINE.replace("  small:", "  p:")
        (tmp_path / "pipelines.yaml").write_text(small + "    " + text + "\n")
        with pytest.raises(ConfigError, match=expected.replace("*", r"\*")):
            load_pipelines(tmp_path / "pipelines.yaml")


def test_plan_follows_the_file(tmp_path):
    from flows.deployments import plan
    from flywheel.config import load_pipelines

    _write(tmp_path, {"a": {"schedule": {"cron": "0 3 * * 1", "timezone": "Europe/Berlin"}},
                      "b": {"trigger": {"min_new_traces": 100}},
                      "c": {}})
    wanted = {p.full_name: p for p in plan(load_pipelines(tmp_path / "pipelines.yaml"), tmp_path)}
    assert set(wanted) == {"retrain/a", "retrain/b", "watch-traces/b"}
    assert wanted["retrain/a"].cron == ("0 3 * * 1", "Europe/Berlin")
    assert wanted["retrain/b"].cron is None, "a trigger-only pipeline's retrain runs when its sensor says"
    assert wanted["watch-traces/b"].every_s == 300
    assert wanted["retrain/a"].parameters == {"pipeline": "a", "root": str(tmp_path)}


def test_stage_job_variables_come_from_stages_json_and_name_what_is_missing(tmp_path):
    import json

    from flows.deployments import DeployError, stage_job_variables
    from flywheel.stages import ORDER

    jobs = stage_job_variables(REPO / "infra/k8s/stages.json")
    assert list(jobs) == list(ORDER), "stages only, in order; `retrain` and `_comment` are not stages"
    assert {name for name, variables in jobs.items() if variables.get("gpus")} == {"sft", "rl", "evaluate"}
    (tmp_path / "stages.json").write_text(json.dumps({k: v for k, v in jobs.items() if k != "rl"}))
    with pytest.raises(DeployError, match=r"stages.json: no job variables \(an object\) for stage\(s\) rl"):
        stage_job_variables(tmp_path / "stages.json")


def test_redeploy_reconciles_schedules_and_deployments(tmp_path, prefect_server):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    from flows.deployments import deploy, plan, reconcile, runner_deployments, stage_job_variables
    from flows.names import stage_deployment
    from flywheel.config import load_pipelines

    root = tmp_path / "project"
    for folder in ("flywheel", "tasks", "flows"):
        shutil.copytree(REPO / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=POOL, type="process"))

    def redeploy(pipelines: dict) -> dict:
        _write(root, pipelines)
        return deploy(root, POOL, plan(load_pipelines(root / "pipelines.yaml"), root))

    redeploy({"a": {"schedule": {"cron": "0 3 * * 1"}},
              "b": {"schedule": {"cron": "0 4 * * *"}, "trigger": {"min_new_traces": 10, "every_s": 60}}})
    assert _state(POOL) == {"retrain/a": ["cron 0 3 * * 1 UTC"], "retrain/b": ["cron 0 4 * * * UTC"],
                            "watch-traces/b": ["every 60s"]}
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("retrain/a")
    assert deployment.entrypoint == "flows/retrain.py:retrain"
    assert deployment.parameters == {"pipeline": "a", "root": str(root)}
    assert deployment.pull_steps[0]["prefect.deployments.steps.set_working_directory"]["directory"] == str(root)

    # a changed cron and time zone replace the old schedule; b loses its schedule but keeps its trigger
    report = redeploy({"a": {"schedule": {"cron": "30 5 * * *", "timezone": "Europe/Berlin"}},
                       "b": {"trigger": {"min_new_traces": 10, "every_s": 120}}})
    assert _state(POOL) == {"retrain/a": ["cron 30 5 * * * Europe/Berlin"], "retrain/b": [],
                            "watch-traces/b": ["every 120s"]}
    assert report["deleted"] == []

    # b's trigger removed too: both its deployments go; deploying again changes nothing
    report = redeploy({"a": {"schedule": {"cron": "30 5 * * *", "timezone": "Europe/Berlin"}}, "b": {}})
    assert sorted(report["deleted"]) == ["retrain/b", "watch-traces/b"]
    assert _state(POOL) == {"retrain/a": ["cron 30 5 * * * Europe/Berlin"]}
    assert redeploy({"a": {"schedule": {"cron": "30 5 * * *", "timezone": "Europe/Berlin"}}})["deleted"] == []
    assert _state(POOL) == {"retrain/a": ["cron 30 5 * * * Europe/Berlin"]}

    # job per stage: retrain/a gets the per-stage job variables as a parameter and stage/a is deployed beside it
    _write(root, {"a": {"schedule": {"cron": "30 5 * * *", "timezone": "Europe/Berlin"}}})
    stage_jobs = stage_job_variables(REPO / "infra/k8s/stages.json")
    assert deploy(root, POOL, plan(load_pipelines(root / "pipelines.yaml"), root, stage_jobs=stage_jobs)) == {
        "kept": ["retrain/a", "stage/a"], "deleted": [],
        "schedules": {"retrain/a": ["cron 30 5 * * * Europe/Berlin"], "stage/a": []}}
    assert _state(POOL) == {"retrain/a": ["cron 30 5 * * * Europe/Berlin"], "stage/a": []}
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(stage_deployment("a"))
        assert client.read_deployment_by_name("retrain/a").parameters["stage_jobs"] == stage_jobs
    assert deployment.entrypoint == "flows/stage.py:stage"
    assert deployment.parameters == {"pipeline": "a", "root": str(root)}
    # deployed again without it: stage/a goes, retrain/a runs every stage in its own flow run again
    report = redeploy({"a": {"schedule": {"cron": "30 5 * * *", "timezone": "Europe/Berlin"}}})
    assert report["deleted"] == ["stage/a"]
    assert _state(POOL) == {"retrain/a": ["cron 30 5 * * * Europe/Berlin"]}
    with get_client(sync_client=True) as client:
        assert "stage_jobs" not in client.read_deployment_by_name("retrain/a").parameters

    # `flywheel serve` registers the same plan as served deployments; the pool's are left alone
    _write(root, {"c": {"trigger": {"min_new_traces": 5}}})
    wanted = plan(load_pipelines(root / "pipelines.yaml"), root)
    for served in runner_deployments(wanted):
        served.apply()
    reconcile(wanted, pool=None, root=root)
    assert _state(None) == {"retrain/c": [], "watch-traces/c": ["every 300s"]}
    assert _state(POOL) == {"retrain/a": ["cron 30 5 * * * Europe/Berlin"]}


def test_k8s_job_template_requests_gpus_for_model_stages_only():
    """The Kubernetes pool's job, rendered with Prefect's templating for each stage's job variables."""
    import json

    from prefect.utilities.templating import apply_values

    from flywheel.stages import ORDER

    template = json.loads((REPO / "infra/k8s/base-job-template.json").read_text())
    stages = json.loads((REPO / "infra/k8s/stages.json").read_text())
    defaults = {k: v["default"] for k, v in template["variables"]["properties"].items() if "default" in v}
    assert set(ORDER) <= set(stages)

    def pod(stage: str) -> dict:
        job = apply_values(template["job_configuration"], {**defaults, **stages[stage], "name": f"small-{stage}"})
        return job["job_manifest"]["spec"]["template"]["spec"]

    for stage in (*ORDER, "retrain", "watch-traces"):
        # every job mounts the project volume at the same path: per-stage jobs hand their outputs on through it
        spec = pod(stage)
        assert {"name": "project", "persistentVolumeClaim": {"claimName": "flywheel-project"}} in spec["volumes"]
        assert {"name": "project", "mountPath": "/project"} in spec["containers"][0]["volumeMounts"]
    spec = apply_values(template["job_configuration"], {**defaults, **stages["sft"], "name": "small-sft",
                                                        "project_volume_claim": "team-rwx", "project_path": "/work"}
                        )["job_manifest"]["spec"]["template"]["spec"]
    assert {"name": "project", "persistentVolumeClaim": {"claimName": "team-rwx"}} in spec["volumes"]
    assert {"name": "project", "mountPath": "/work"} in spec["containers"][0]["volumeMounts"]
    for stage in ("sft", "rl", "evaluate", "retrain"):
        spec = pod(stage)
        assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1, stage
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    for stage in ("collect", "synthesize", "register", "watch-traces"):
        spec = pod(stage)
        assert "nvidia.com/gpu" not in spec["containers"][0]["resources"]["limits"], stage
        assert spec["nodeSelector"] == {} and spec["tolerations"] == []


def test_serve_and_deploy_say_what_is_missing(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from flywheel.cli import app

    _write(tmp_path, {"a": {}})
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    served = CliRunner().invoke(app, ["serve", "--root", str(tmp_path)])
    assert served.exit_code == 2 and "no pipeline has a `schedule` or a `trigger`" in served.output
    deployed = CliRunner().invoke(app, ["deploy", "--pool", "p", "--root", str(tmp_path)])
    assert deployed.exit_code == 2 and "needs a Prefect server: set PREFECT_API_URL" in deployed.output


@pytest.mark.slow
def test_flywheel_serve_runs_the_schedules_on_its_own_server(project, tmp_path):
    """`flywheel serve` with no PREFECT_API_URL starts a local server and runs the sensor on its schedule."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.deployments import free_port, stop_process_group

    (project / "pipelines.yaml").write_text(SMALL_PIPELINE + "    trigger: {min_new_traces: 100000, every_s: 10}\n")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env |= {"PREFECT_HOME": str(tmp_path / "serve-home"), "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2"}
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        serving = subprocess.Popen([sys.executable, "-m", "flywheel.cli", "serve", "--root", str(project), "--port",
                                    str(port)], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        completed = []
        while not completed:
            assert serving.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(3)
            if "served from this process" not in log.read_text():
                continue
            with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{port}/api"}), \
                    get_client(sync_client=True) as client:
                completed = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                    state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.COMPLETED]))))
        text = log.read_text()
        assert "started a local Prefect server" in text and "watch-traces/small: every 10s" in text
        assert "retrain/small: no schedule (started by its sensor)" in text
    finally:
        stop_process_group(serving, signal.SIGINT, timeout_s=30)
    assert "Completed" in str(completed[0].state)


def test_retrain_with_stage_jobs_says_what_is_missing(project, prefect_server):
    """Job per stage without the `stage/<pipeline>` deployment, or without a stage's variables: a clear error."""
    from flows.deployments import stage_job_variables
    from flows.retrain import retrain

    # its own pipeline name: the session's Prefect server is shared, and other tests expect no runs of `small`
    (project / "pipelines.yaml").write_text(SMALL_PIPELINE.replace("  small:", "  lonely:"))
    stage_jobs = stage_job_variables(REPO / "infra/k8s/stages.json")
    with pytest.raises(ValueError, match=r"stage_jobs has no job variables for \['register'\]"):
        retrain(pipeline="lonely", root=str(project), stage_jobs={k: v for k, v in stage_jobs.items()
                                                                  if k != "register"})
    with pytest.raises(RuntimeError, match=r"no deployment 'stage/lonely': deploy it with `flywheel deploy --pool "
                                           r"POOL --job-per-stage`"):
        retrain(pipeline="lonely", root=str(project), stage_jobs=stage_jobs)
    assert not (project / "data/lonely/collect").exists(), "nothing ran"
