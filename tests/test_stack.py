"""`flywheel stack`: the company's servers as processes (PostgreSQL, S3, Prefect and MLflow servers, workers), with
the same names, ports and variables as infra/docker-compose.yml."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, SMALL_PIPELINE
from test_servers import _final

from flows import stack

BIN = Path(sys.executable).parent


def _default(value: str) -> str:
    """A compose value with its `${VAR:-default}` references replaced by the defaults."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def test_the_stack_and_the_compose_file_name_the_same_services_ports_and_variables():
    compose = yaml.safe_load((REPO / "infra/docker-compose.yml").read_text())
    services = compose["services"]
    ports = {int(p.split(":")[0]) for s in services.values() for p in s.get("ports", [])}
    defaults = stack.Ports()
    assert {defaults.prefect, defaults.mlflow, defaults.s3} <= ports
    assert f"--port {defaults.prefect}" in services["prefect-server"]["command"]
    assert f"--port {defaults.mlflow}" in services["mlflow"]["command"]
    for database, role in stack.DATABASES.items():
        env = services[f"{database}-db"]["environment"]
        assert (env["POSTGRES_DB"], env["POSTGRES_USER"], _default(env["POSTGRES_PASSWORD"])) == (database, role, role)
    minio = services["minio"]["environment"]
    assert _default(minio["MINIO_ROOT_USER"]) == stack.S3_CREDENTIALS["AWS_ACCESS_KEY_ID"]
    assert _default(minio["MINIO_ROOT_PASSWORD"]) == stack.S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"]
    assert f'"{stack.BUCKET}"' in services["minio-init"]["command"][-1]
    mlflow = " ".join(services["mlflow"]["command"].split())
    assert f"--artifacts-destination s3://{stack.BUCKET}/mlflow" in mlflow

    worker = {k: _default(str(v)) for k, v in services["worker"]["environment"].items()}
    ours = stack.Stack("/project", defaults, "http://minio:9000", {}).client_env()
    assert set(ours) == set(worker) - {"HF_HUB_OFFLINE"}, "the variables a worker gets"
    hosts = {"prefect-server": "127.0.0.1", "mlflow": "127.0.0.1", "minio": "minio"}
    for name, value in worker.items():
        if name in ours:
            assert ours[name] == re.sub(r"//([a-z-]+):", lambda m: f"//{hosts.get(m[1], m[1])}:", value), name
    assert f"--pool {stack.POOL} --type process" in services["worker"]["command"]
    server = services["prefect-server"]["environment"]
    assert server["PREFECT_SERVER_ANALYTICS_ENABLED"] == stack.PREFECT_SERVER_ENV["PREFECT_SERVER_ANALYTICS_ENABLED"]
    assert server["PREFECT_API_DATABASE_CONNECTION_URL"].startswith("postgresql+asyncpg://prefect:")


def _candidate(tmp_path: Path, recorded, label: str, solved: int) -> str:
    """A version of model `race` on the stack's MLflow whose stored eval table solves `solved` of 40 tasks."""
    from test_promotion import _eval_table

    from flywheel import registry

    folder = tmp_path / "race" / label
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "config.json").write_text(f'{{"id": "{label}"}}')
    previous = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = recorded.mlflow_uri
    try:
        run = registry.start_run(tmp_path, "race", "register")
        return registry.register(run, "race", folder / "model", f"hash-{label}", {}, ["challenger"],
                                 eval_table=_eval_table(folder, solved)).version
    finally:
        if previous is None:
            os.environ.pop("MLFLOW_TRACKING_URI")
        else:
            os.environ["MLFLOW_TRACKING_URI"] = previous


def _outputs(project: Path) -> dict[str, str]:
    """md5 of every file of the pipeline's datasets and models, less what differs by design (the eval table's
    measured latency, the checkpoints a run removes when it ends), and the version registered with its hash."""
    import hashlib

    files = [p for folder in ("data/small", "models/small") for p in sorted((project / folder).rglob("*"))
             if p.is_file() and "checkpoints" not in str(p) and p.name not in ("eval.parquet", "registration.json")]
    registered = json.loads((project / "data/small/register/registration.json").read_text())
    return {str(p.relative_to(project)): hashlib.md5(p.read_bytes()).hexdigest() for p in files} | {
        "registered": (registered["version"], registered["model_hash"])}  # its promotion reasons say what changed


def _healthy(shown: subprocess.CompletedProcess) -> bool:
    """`flywheel stack status` said every process runs and answers (else raises, for _answers to try again)."""
    assert shown.returncode == 0, shown.stdout + shown.stderr
    return True


def _answers(check, timeout_s: float = 60):
    """check() once it stops raising (a server reconnecting); its last error if it never does."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return check()
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


@pytest.mark.slow
@pytest.mark.waits  # four minutes at half a core, mostly waiting on schedules: on a worker of its own
def test_the_stack_runs_a_schedule_survives_a_database_restart_and_marks_a_killed_run(project, tmp_path):
    """`flywheel stack up` on free ports; PostgreSQL stopped under both servers (`flywheel stack status` exits 1
    naming it) and started again (status 0); a one-minute cron deployed with `flywheel deploy` fires and a worker
    runs it, then is paused with nothing left running; a run whose worker and process are killed is CRASHED, not
    RUNNING, and its pipeline slot released, once `flywheel status` looks, and the next run resumes to the same
    outputs; two runs at once, one refused; the Prefect server restarted mid-run; traces landing fire the trigger;
    two promotions at once leave one champion; `flywheel stack down` leaves nothing running."""
    from mlflow import MlflowClient
    from prefect import get_client
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        FlowRunFilterTags,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.deployments import free_port
    from flows.runlock import lock_path

    (project / "pipelines.yaml").write_text(SMALL_PIPELINE + '    schedule: {cron: "* * * * *", timezone: UTC}\n')
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "every minute"],
                   cwd=project, check=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    base |= {"PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONPATH": str(project), "COLUMNS": "200",
             "PREFECT_HOME": str(tmp_path / "client-home")}

    def flywheel(env: dict, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "flywheel"), *args, "--root", str(project)], cwd=project, env=env,
                              capture_output=True, text=True, timeout=600)

    ports = [str(free_port()) for _ in range(4)]
    started = flywheel(base, "stack", "up", "--prefect-port", ports[0], "--mlflow-port", ports[1], "--s3-port",
                       ports[2], "--postgres-port", ports[3])
    recorded = stack.load(project)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        assert f"Prefect     http://127.0.0.1:{ports[0]}/api" in started.stdout
        assert set(recorded.pids) == {"postgres", "s3", "prefect", "mlflow", "worker-0", "worker-1"}
        env = base | recorded.client_env()
        shown = flywheel(env, "stack", "status")
        assert shown.returncode == 0 and shown.stdout.count("running") == 6, shown.stdout
        assert "health 200, database read 200" in shown.stdout
        exported = flywheel(base, "stack", "env").stdout
        assert f"export PREFECT_API_URL=http://127.0.0.1:{ports[0]}/api" in exported

        # PostgreSQL stopped under both servers: status says so, for it and for the servers that need it
        stack.stop_postgres(recorded)
        shown = flywheel(env, "stack", "status")
        assert shown.returncode == 1, shown.stdout + shown.stderr
        lines = {line.split()[0]: line for line in shown.stdout.splitlines()}
        assert "STOPPED" in lines["postgres"] or "DOWN" in lines["postgres"], shown.stdout
        for server in ("prefect", "mlflow"):
            assert " DOWN " in lines[server] and "PostgreSQL" in lines[server], shown.stdout
        # started again by `stack up`: both servers reconnect
        again = flywheel(base, "stack", "up", "--prefect-port", ports[0], "--mlflow-port", ports[1], "--s3-port",
                         ports[2], "--postgres-port", ports[3])
        assert again.returncode == 0, again.stdout + again.stderr
        recorded = stack.load(project)
        mlflow = MlflowClient(recorded.mlflow_uri)
        assert _answers(lambda: mlflow.create_experiment("after-restart"))
        assert _answers(lambda: _healthy(flywheel(env, "stack", "status")), timeout_s=180)
        with temporary_settings({PREFECT_API_URL: recorded.prefect_api}), get_client(sync_client=True) as client:
            assert _answers(lambda: client.read_work_pool(stack.POOL)).type == "process"

            deployed = flywheel(env, "deploy", "--pool", stack.POOL, "--results", f"s3://{stack.BUCKET}/prefect-results")
            assert deployed.returncode == 0, deployed.stdout + deployed.stderr
            assert "retrain/small: cron * * * * * UTC" in deployed.stdout
            [deployment] = client.read_deployments(
                deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["small"])))
            # the schedule fires (the next minute) and a worker runs it
            deadline = time.monotonic() + 150
            while True:
                runs = client.read_flow_runs(deployment_filter=DeploymentFilter(
                    name=DeploymentFilterName(any_=["small"])), flow_run_filter=FlowRunFilter(
                    state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING,
                                                                                StateType.COMPLETED]))))
                if runs:
                    break
                assert time.monotonic() < deadline, "no scheduled run started within 150 s"
                time.sleep(2)
            scheduled = _final(client, runs[0].id, timeout_s=420)
            assert scheduled.state.is_completed(), scheduled.state.message
            assert scheduled.deployment_id == deployment.id and scheduled.auto_scheduled
            # no more minutes firing while the faults are tried, and none fired just before still running
            stack.pause_deployment(client, "retrain/small", timeout_s=420)
            uninterrupted = _outputs(project)

            # a run whose workers and process are killed mid-SFT (a machine lost): status marks it CRASHED
            victim = run_deployment("retrain/small", parameters={"refresh": True}, timeout=0)
            record = lock_path(project, "small")
            checkpoints = project / "models/small/sft-checkpoints"
            deadline = time.monotonic() + 240
            while not (str(victim.id) in (held := record.read_text() if record.exists() else "")
                       and any(checkpoints.glob("checkpoint-*/trainer_state.json"))
                       and "flywheel.slot:small" in client.read_flow_run(victim.id).tags):  # it holds the slot
                state = client.read_flow_run(victim.id).state
                assert not state.is_final(), f"the victim run ended before an SFT checkpoint: {state}"
                assert time.monotonic() < deadline, (f"the victim run never reached an SFT checkpoint within 240 s "
                                                     f"({state.name}; lock record: {held!r})")
                time.sleep(0.5)
            # the record the loop read: its holder rewrites it in place (truncate, write), so a second read may find
            # it empty, as one did in a CI run
            pid = json.loads(held)["pid"]
            for name in ("worker-0", "worker-1"):
                os.killpg(recorded.pids[name], signal.SIGKILL)
            os.kill(pid, signal.SIGKILL)
            time.sleep(1)
            assert client.read_flow_run(victim.id).state.type == StateType.RUNNING, "nothing reported it yet"
            status = flywheel(env, "status", "small")
            assert f"small: the run pid {pid} on" in status.stdout, status.stdout + status.stderr
            assert client.read_flow_run(victim.id).state.type == StateType.CRASHED
            # and the slot it held on the server (flows/concurrency.py) is released, not left to its lease
            assert f"released slot flywheel-retrain-small of flow run {victim.id}" in status.stdout, status.stdout

            # workers back; two runs at once: one stops naming the other; the Prefect server restarts under the
            # other, which finishes, and its outputs are the uninterrupted run's, byte for byte
            again = flywheel(base, "stack", "up", "--prefect-port", ports[0], "--mlflow-port", ports[1], "--s3-port",
                             ports[2], "--postgres-port", ports[3])
            assert again.returncode == 0, again.stdout + again.stderr
            recorded = stack.load(project)
            pair = [run_deployment("retrain/small", parameters={"refresh": True}, timeout=0) for _ in range(2)]
            deadline = time.monotonic() + 240
            while not any(str(r.id) in (held := record.read_text() if record.exists() else "") for r in pair):
                assert time.monotonic() < deadline, "neither run took the lock"
                time.sleep(0.2)
            [holder] = [r for r in pair if str(r.id) in held]
            [other] = [r for r in pair if r.id != holder.id]
            refused = _final(client, other.id, timeout_s=240)
            assert refused.state.type == StateType.FAILED, refused.state
            assert f"Prefect flow run {holder.id}" in refused.state.message, refused.state.message
            assert not client.read_flow_run(holder.id).state.is_final(), "the holder ended before the restart"
            stack.restart_prefect(recorded)
            finished = _answers(lambda: _final(client, holder.id, timeout_s=600), timeout_s=120)
            assert finished.state.is_completed(), finished.state
            assert _outputs(project) == uninterrupted

            # traces land: the trigger (the pipeline now has only it) starts a retrain that a worker runs
            (project / "pipelines.yaml").write_text(
                SMALL_PIPELINE + "    trigger: {min_new_traces: 10, every_s: 86400}\n")
            first = (project / "examples/traces/support-agent-2026-11-01.jsonl").read_text().splitlines()[:20]
            (project / "examples/traces/support-agent-late.jsonl").write_text(
                "".join(re.sub(r'^\{"id": "(tr_\w+)"', r'{"id": "\1-late"', line) + "\n" for line in first))
            redeployed = flywheel(env, "deploy", "--pool", stack.POOL)
            assert "watch-traces/small: every 86400s" in redeployed.stdout, redeployed.stdout + redeployed.stderr
            sensor = run_deployment("watch-traces/small", timeout=240, poll_interval=2)
            assert sensor.state.is_completed(), sensor.state
            [triggered] = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(
                all_=["flywheel.trigger"])))
            assert _final(client, triggered.id, timeout_s=420).state.is_completed()
            shown = flywheel(env, "status", "small")  # the runs from the stack's MLflow, the schedule from Prefect
            assert shown.returncode == 0, shown.stdout + shown.stderr
            assert shown.stdout.count("FINISHED") >= 3 and "deployment retrain/small" in shown.stdout, shown.stdout

        # two workers finishing two candidates at once, through MLflow on PostgreSQL: exactly one champion
        race = {label: _candidate(tmp_path, recorded, label, solved) for label, solved in (("better", 39),
                                                                                            ("worse", 30))}
        script = ("import sys; from flywheel import promotion; from tests.test_promotion import GATE; "
                  "d = promotion.gate_against_champion('race', sys.argv[1], None, GATE); "
                  "print(promotion.promote('race', sys.argv[1], GATE, decision=d, judged_against=None).promoted)")
        racers = [subprocess.Popen([sys.executable, "-c", script, v], cwd=REPO, env=env | {"PYTHONPATH": str(REPO)},
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for v in race.values()]
        said = []
        for racer in racers:
            out, err = racer.communicate(timeout=180)
            assert racer.returncode == 0, err[-2000:]
            said.append(out + err[-1500:])
        registry_client = MlflowClient(recorded.mlflow_uri)
        assert registry_client.get_model_version_by_alias("race", "champion").version == race["better"], said
        assert "champion" not in registry_client.get_model_version("race", race["worse"]).aliases
    finally:
        flywheel(base, "stack", "down")
        data = stack.data_folder(recorded)
        if data.parent.name.startswith("flywheel-stack-"):  # under /var/tmp when the tests run as root
            shutil.rmtree(data.parent, ignore_errors=True)
    assert stack.load(project) is None
    assert not any(stack.alive(pid) for pid in recorded.pids.values()), "stack down leaves nothing running"
