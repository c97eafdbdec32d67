"""Like a company runs it: a Prefect server, an MLflow server with S3 artifacts, a DVC S3 remote, a process worker.

Every server is a real process on loopback started by the fixtures; S3 is moto's server. The small pipeline is
deployed with `flywheel deploy --job-per-stage`, its sensor finds the example traces new and starts
`retrain/small`, which the worker runs, each stage as its own `stage/small` flow run with that stage's job
variables from infra/k8s/stages.json (the shared state is the project folder, as a volume would be); then the
artifacts are in S3, a fresh clone's `dvc pull` restores the datasets and the champion loads from the registry.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, SMALL_PIPELINE

POOL = "cpu-pool"


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                   capture_output=True, text=True)


def _dvc(root: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _md5s(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _final(client, run_id, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        run = client.read_flow_run(run_id)
        if run.state and run.state.is_final():
            return run
        assert time.monotonic() < deadline, f"flow run {run_id} still {run.state.name} after {timeout_s}s"
        time.sleep(2)


@pytest.mark.slow
def test_deployed_retrain_on_servers_with_s3(project, prefect_api, mlflow_server, s3_bucket, process_worker,
                                             monkeypatch, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterTags
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flywheel.stages import ORDER

    s3, bucket = s3_bucket
    tracking_uri, _ = mlflow_server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    # the team's setup: an S3 DVC remote (endpoint and keys from the AWS_* variables), a schedule and a trigger
    _dvc(project, "remote", "add", "-d", "--force", "s3", f"s3://{bucket}/dvc")
    (project / "pipelines.yaml").write_text(
        SMALL_PIPELINE + '    schedule: {cron: "0 3 1 1 *", timezone: UTC}\n'
                         "    trigger: {min_new_traces: 50, every_s: 86400}\n")
    _git(project, "commit", "-qam", "S3 remote, schedule and trigger")

    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PREFECT_WORKER_QUERY_SECONDS": "2",
           "PREFECT_HOME": str(tmp_path / "worker-home"), "OMP_NUM_THREADS": "1"}
    with temporary_settings({PREFECT_API_URL: prefect_api}), get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=POOL, type="process"))
        deployed = subprocess.run([sys.executable, "-m", "flywheel.cli", "deploy", "--pool", POOL, "--root",
                                   str(project), "--results", f"s3://{bucket}/prefect-results", "--job-per-stage",
                                   "--stage-variables", str(REPO / "infra/k8s/stages.json")],
                                  env=env, capture_output=True, text=True)
        assert deployed.returncode == 0, deployed.stderr
        assert "retrain/small: cron 0 3 1 1 * UTC" in deployed.stdout
        assert "watch-traces/small: every 86400s" in deployed.stdout
        assert "stage/small: no schedule" in deployed.stdout
        process_worker(POOL, env)

        from prefect.deployments import run_deployment

        sensor = run_deployment("watch-traces/small", timeout=240, poll_interval=2)
        assert sensor.state.is_completed(), sensor.state
        started = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(
            all_=["flywheel.trigger"])))
        assert len(started) == 1, "150 example traces are new: the sensor starts one retrain"
        retrain = _final(client, started[0].id, timeout_s=420)
        assert retrain.state.is_completed(), retrain.state.message

        # each stage ran as its own flow run of the `stage` flow, a child of the retrain, with its job variables
        stage_runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["stage"])),
                                           sort=FlowRunSort.START_TIME_ASC)
        assert [r.parameters["name"] for r in stage_runs] == list(ORDER)
        for run in stage_runs:
            assert run.state.is_completed() and run.parent_task_run_id is not None, run.name
            assert client.read_task_run(run.parent_task_run_id).flow_run_id == retrain.id
        gpus = {r.parameters["name"]: r.job_variables.get("gpus") for r in stage_runs}
        assert gpus == {"collect": None, "synthesize": None, "sft": 1, "rl": 1, "evaluate": 1, "register": None}

        # nothing new since the retrain's collect: the sensor starts nothing more
        again = run_deployment("watch-traces/small", timeout=240, poll_interval=2)
        assert again.state.is_completed()
        assert len(client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(
            all_=["flywheel.trigger"])))) == 1

    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
            for o in page.get("Contents", [])]
    assert any(k.startswith("mlflow/") and k.endswith("/model.safetensors") for k in keys), keys[:20]
    assert any(k.startswith("dvc/files/md5/") for k in keys)
    assert any(k.startswith("prefect-results/") for k in keys), "the stage caches live in S3"

    # what a team does after a run: commit dvc.lock; a fresh clone then gets the data from the S3 remote
    _git(project, "add", "dvc.lock")
    _git(project, "commit", "-qm", "data of the deployed run")
    clone = tmp_path / "clone"
    _git(tmp_path, "clone", "-q", str(project), str(clone))
    _dvc(clone, "pull")
    import yaml

    lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
    # every output dvc.lock records, less register's (`cache: false`: the registry's answer, not in the remote)
    outs = [out["path"] for name, stage in lock.items() if not name.startswith("register@")
            for out in stage["outs"]]
    assert {"data/small/collect", "data/small/synthesize", "models/small/rl"} <= set(outs)
    for out in outs:
        made = _md5s(project / out)
        assert made and _md5s(clone / out) == made, out

    import mlflow.artifacts
    from transformers import AutoModelForCausalLM

    from flywheel.registry import checkpoint_in

    # the champion is an MLflow model (MLmodel + the checkpoint under its artifacts), all of it from S3
    model_dir = mlflow.artifacts.download_artifacts(artifact_uri="models:/small@champion",
                                                    dst_path=str(tmp_path / "champion"))
    assert (Path(model_dir) / "MLmodel").exists()
    model = AutoModelForCausalLM.from_pretrained(checkpoint_in(Path(model_dir)))
    assert model.num_parameters() > 0


def test_compose_file_has_the_servers_the_readme_names():
    """docker-compose.yml cannot be started here (no Docker): its structure is checked instead."""
    import yaml
    from conftest import REPO

    compose = yaml.safe_load((REPO / "infra/docker-compose.yml").read_text())
    services = compose["services"]
    assert {"prefect-server", "prefect-db", "mlflow", "mlflow-db", "minio", "minio-init", "worker"} <= set(services)
    assert "postgresql+asyncpg://" in services["prefect-server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    mlflow = " ".join(services["mlflow"]["command"].split())
    assert "--backend-store-uri postgresql+psycopg2://" in mlflow  # SQLAlchemy 2.1's default driver is psycopg 3
    assert "--artifacts-destination s3://flywheel/mlflow" in mlflow
    assert services["mlflow"]["build"]["dockerfile"] == "infra/Dockerfile"
    assert (REPO / services["mlflow"]["build"]["dockerfile"]).exists()
    assert {"4200:4200", "5000:5000", "9000:9000"} <= {p for s in services.values() for p in s.get("ports", [])}
    readme = (REPO / "infra/README.md").read_text()
    for worker in ("worker", "worker-gpu"):
        env = services[worker]["environment"]
        for name in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
                     "AWS_SECRET_ACCESS_KEY", "AWS_REQUEST_CHECKSUM_CALCULATION", "AWS_RESPONSE_CHECKSUM_VALIDATION",
                     "FLYWHEEL_RESULTS_URL"):
            assert name in env, (worker, name)
            assert name in readme, name
        assert "prefect worker start" in services[worker]["command"]
    assert services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert services["minio-init"]["depends_on"]["minio"]["condition"] == "service_healthy"
