"""`flywheel stack up|down|status|env`: the servers a company runs, as processes on 127.0.0.1, without Docker.

The same services, names, ports and variables as infra/docker-compose.yml (tests/test_stack.py compares them):
- PostgreSQL, one cluster under `.flywheel/stack/postgres` (made with `initdb` on first use) holding the
  databases `prefect` and `mlflow`, each owned by the role of the same name;
- S3: moto's server on the MinIO port (`--s3-endpoint` points at MinIO or AWS instead), bucket `flywheel`
  with the prefixes `dvc/`, `mlflow/` (MLflow's artifacts) and `prefect-results/`;
- a Prefect server on PostgreSQL, and a process work pool `cpu-pool` with two workers running in the project;
- an MLflow tracking server on PostgreSQL, its artifacts in S3.
Every process leads its own process group and logs to `.flywheel/stack/logs/`; `.flywheel/stack/stack.json`
records what runs, so `status` and `down` find it from any shell. `down` stops everything and keeps the data.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from flows.deployments import serving
from flywheel.errors import UserFacingError
from flywheel.settings import state_dir

BIN = Path(sys.executable).parent
POOL = "cpu-pool"
BUCKET = "flywheel"
DATABASES = {"prefect": "prefect", "mlflow": "mlflow"}  # database -> owner role (password: the same, as compose)
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "flywheel", "AWS_SECRET_ACCESS_KEY": "flywheel-secret",
                  "AWS_DEFAULT_REGION": "us-east-1"}
SUPERUSER = "flywheel"
WORKERS = 2
# Prefect's scheduler tops up scheduled runs every 10 s (default 60): a new cron's runs exist within seconds; the
# leases of concurrency slots (flows/concurrency.py) are kept on disk, not in memory, so a restart loses none
PREFECT_SERVER_ENV = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                      "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "10",
                      "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect.server.concurrency.lease_storage.filesystem"}
# What a worker and the flow runs it starts get beyond the client variables: heartbeats every 30 s (Prefect's
# minimum; default 180) so that a run whose process died is marked CRASHED after HEARTBEAT_GRACE_S, and client
# retries that outlast a Prefect server restart of a few minutes (8 retries, 2**n s apart: about 8.5 minutes).
WORKER_ENV = {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30", "PREFECT_CLIENT_MAX_RETRIES": "8",
              "PREFECT_WORKER_QUERY_SECONDS": "5"}
HEARTBEAT_GRACE_S = 75
CRASH_AUTOMATION = "flywheel-crash-silent-flow-runs"


class StackError(UserFacingError, RuntimeError):
    """The stack cannot start (a port taken, PostgreSQL missing) or is not up; the message says what to do."""


@dataclass(frozen=True)
class Ports:
    """Where the services listen (compose's defaults; PostgreSQL is not published by compose: 5432 inside)."""

    prefect: int = 4200
    mlflow: int = 5000
    s3: int = 9000
    postgres: int = 5432


@dataclass
class Stack:
    """What `up` started: ports, the S3 endpoint, and each process's pid (0: not started by us)."""

    root: str
    ports: Ports
    s3_endpoint: str
    pids: dict[str, int]

    @property
    def prefect_api(self) -> str:
        return f"http://127.0.0.1:{self.ports.prefect}/api"

    @property
    def mlflow_uri(self) -> str:
        return f"http://127.0.0.1:{self.ports.mlflow}"

    def client_env(self) -> dict[str, str]:
        """What a shell, `flywheel deploy` or a worker needs to use the stack (compose's x-worker-env)."""
        return {"PREFECT_API_URL": self.prefect_api, "MLFLOW_TRACKING_URI": self.mlflow_uri,
                **S3_CREDENTIALS, "AWS_ENDPOINT_URL": self.s3_endpoint, "MLFLOW_S3_ENDPOINT_URL": self.s3_endpoint,
                "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
                "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",
                "FLYWHEEL_RESULTS_URL": f"s3://{BUCKET}/prefect-results", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "MLFLOW_DISABLE_TELEMETRY": "true"}


def stack_dir(root: Path) -> Path:
    return state_dir(root) / "stack"


def _record(root: Path) -> Path:
    return stack_dir(root) / "stack.json"


def load(root: Path) -> Stack | None:
    """The stack `up` recorded for this project, or None."""
    path = _record(root)
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return Stack(data["root"], Ports(**data["ports"]), data["s3_endpoint"], data["pids"])


def _save(stack: Stack) -> None:
    _record(Path(stack.root)).write_text(json.dumps(asdict(stack), indent=2))


def alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's (PostgreSQL runs as `nobody` under root)
        return True
    try:  # a zombie (exited, not yet reaped by its parent) is not running
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True


def up(root: Path, ports: Ports = Ports(), s3_endpoint: str | None = None, workers: int = WORKERS,
       say=print) -> Stack:
    """Start every service that is not running yet; return the stack (recorded for `status` and `down`)."""
    root = root.resolve()
    folder = stack_dir(root)
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    stack = load(root)
    if stack is not None and any(alive(pid) for pid in stack.pids.values()):
        if stack.ports != ports and ports != Ports():
            raise StackError(f"the stack of {root} is already up on other ports ({stack.ports}); "
                             "`flywheel stack down` first")
    else:
        stack = Stack(str(root), ports, s3_endpoint or f"http://127.0.0.1:{ports.s3}", {})
    ports = stack.ports
    try:
        _postgres(stack, say)
        _save(stack)
        if s3_endpoint is None and not alive(stack.pids.get("s3", 0)):
            if not (BIN / "moto_server").exists():
                raise StackError("no S3 to use: moto's server is not installed (the dev extra, `make setup`, "
                                 "installs it); or give --s3-endpoint of an S3 you run (MinIO, AWS)")
            stack.pids["s3"] = _start(stack, "s3", [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p",
                                                    str(ports.s3)], {})
            _wait_port(ports.s3, stack, "s3")
        _bucket(stack)
        _save(stack)
        if not alive(stack.pids.get("prefect", 0)):
            _start_prefect(stack)
        if not alive(stack.pids.get("mlflow", 0)):
            stack.pids["mlflow"] = _start(stack, "mlflow", [
                str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(ports.mlflow),
                "--backend-store-uri", f"postgresql+psycopg2://mlflow:mlflow@127.0.0.1:{ports.postgres}/mlflow",
                "--artifacts-destination", f"s3://{BUCKET}/mlflow", "--workers", "1"],
                {**stack.client_env(), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        _save(stack)
        _wait_http(f"{stack.prefect_api}/health", stack, "prefect")
        _wait_http(f"{stack.mlflow_uri}/health", stack, "mlflow")
        _crash_automation(stack)
        if not any(alive(stack.pids.get(f"worker-{i}", 0)) for i in range(workers)):
            subprocess.run([str(BIN / "prefect"), "work-pool", "create", POOL, "--type", "process", "--overwrite"],
                           env=_env(stack.client_env()), check=True, capture_output=True, text=True)
        for i in range(workers):
            name = f"worker-{i}"
            if not alive(stack.pids.get(name, 0)):
                stack.pids[name] = _start(stack, name, [
                    str(BIN / "prefect"), "worker", "start", "--pool", POOL, "--type", "process", "--name",
                    f"{root.name}-{name}"], {**stack.client_env(), **WORKER_ENV})
        _save(stack)
    except BaseException:
        _save(stack)  # what did start can be stopped by `down`
        raise
    say(describe(stack))
    return stack


def _crash_automation(stack: Stack) -> None:
    """The automation that sets a flow run CRASHED once its heartbeats stop for HEARTBEAT_GRACE_S (its process
    died with the machine, the pod or the worker's whole process tree). Prefect's server has no such check of its
    own; made once per server."""
    from datetime import timedelta

    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: stack.prefect_api}):
        try:
            Automation.read(name=CRASH_AUTOMATION)
            return
        except ValueError:  # none by that name yet
            pass
        Automation(
            name=CRASH_AUTOMATION, description="flywheel stack: a RUNNING flow run whose heartbeats stopped",
            trigger=EventTrigger(
                match={"prefect.resource.id": "prefect.flow-run.*"}, after={"prefect.flow-run.heartbeat"},
                expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                        "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"},
                for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1,
                within=timedelta(seconds=HEARTBEAT_GRACE_S)),
            actions=[ChangeFlowRunState(state=StateType.CRASHED, message=(
                f"no heartbeat for {HEARTBEAT_GRACE_S} s: the process running this flow run died "
                "(killed with its worker, or its machine)"))],
        ).create()


def describe(stack: Stack) -> str:
    ports = stack.ports
    return "\n".join([
        f"PostgreSQL  127.0.0.1:{ports.postgres} (databases prefect, mlflow; data in {stack_dir(Path(stack.root))})",
        f"S3          {stack.s3_endpoint} (bucket {BUCKET}: dvc/, mlflow/, prefect-results/)",
        f"Prefect     {stack.prefect_api} (UI http://127.0.0.1:{ports.prefect}), pool {POOL}, "
        f"{sum(name.startswith('worker-') for name in stack.pids)} process workers",
        f"MLflow      {stack.mlflow_uri}",
        'use it from a shell: eval "$(flywheel stack env)"; then `flywheel deploy --pool cpu-pool`'])


@dataclass(frozen=True)
class Health:
    """One process of the stack as `flywheel stack status` shows it."""

    service: str
    pid: int
    state: str  # "running"; "STOPPED": its process is gone; "DOWN": it runs but cannot serve (its database)
    detail: str

    @property
    def ok(self) -> bool:
        return self.state == "running"


# what each server is asked: its /health (which answers without a database), and a request that reads its
# database (PostgreSQL)
_CHECKS = {"prefect": ("/api/health", "/api/flow_runs/filter", {"limit": 1}),
           "mlflow": ("/health", "/api/2.0/mlflow/experiments/search", {"max_results": 1})}


def status(root: Path) -> list[Health]:
    """Each process of the recorded stack: running or not, and whether PostgreSQL and the servers on it answer."""
    stack = load(root.resolve())
    if stack is None:
        raise StackError(f"no stack recorded under {stack_dir(root.resolve())}: `flywheel stack up` first")
    postgres_error = _postgres_error(stack) if alive(stack.pids.get("postgres", 0)) else "is not running"
    urls = {"prefect": f"http://127.0.0.1:{stack.ports.prefect}", "mlflow": stack.mlflow_uri}
    rows = []
    for name, pid in stack.pids.items():
        if not alive(pid):
            rows.append(Health(name, pid, "STOPPED", "`flywheel stack up` starts it again"))
        elif name == "postgres":
            rows.append(Health(name, pid, "DOWN", f"PostgreSQL {postgres_error}") if postgres_error else
                        Health(name, pid, "running", f"accepting connections on 127.0.0.1:{stack.ports.postgres}"))
        elif name in urls:
            rows.append(_server_health(stack, name, pid, urls[name], postgres_error))
        else:
            rows.append(Health(name, pid, "running", ""))
    return rows


def _postgres_error(stack: Stack) -> str | None:
    """None if PostgreSQL answers a query on the stack's port; else what went wrong."""
    import psycopg2

    try:
        connection = psycopg2.connect(host="127.0.0.1", port=stack.ports.postgres, user=SUPERUSER,
                                      dbname="postgres", connect_timeout=3)
    except psycopg2.Error as err:
        return f"does not accept connections on 127.0.0.1:{stack.ports.postgres} ({str(err).strip()})"
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except psycopg2.Error as err:
        return f"does not answer a query ({str(err).strip()})"
    finally:
        connection.close()
    return None


def _server_health(stack: Stack, name: str, pid: int, url: str, postgres_error: str | None) -> Health:
    """A server's /health, and a request that needs its database: DOWN, naming PostgreSQL, when that fails."""
    health_path, path, body = _CHECKS[name]
    try:
        health = httpx.get(f"{url}{health_path}", timeout=5).status_code
        read = httpx.post(f"{url}{path}", json=body, timeout=20).status_code
    except httpx.HTTPError as err:
        return Health(name, pid, "DOWN", f"not answering ({type(err).__name__})")
    if read == 200:
        return Health(name, pid, "running", f"health {health}, database read {read} (POST {path})")
    log = stack_dir(Path(stack.root)) / "logs" / f"{name}.log"
    cause = f"its database, PostgreSQL, {postgres_error}" if postgres_error else f"PostgreSQL answers: see {log}"
    return Health(name, pid, "DOWN", f"health {health}, but a database read fails (POST {path}: {read}): {cause}")


def down(root: Path, say=print) -> None:
    """Stop the workers, the servers and PostgreSQL (SIGTERM, then SIGKILL); the data stays."""
    root = root.resolve()
    stack = load(root)
    if stack is None:
        say("no stack recorded: nothing to stop")
        return
    order = [n for n in stack.pids if n.startswith("worker-")] + ["prefect", "mlflow", "s3"]
    for name in order:
        pid = stack.pids.get(name, 0)
        if alive(pid):
            _stop(pid)
            say(f"stopped {name} (pid {pid})")
    if alive(stack.pids.get("postgres", 0)):
        _as_owner(stack, [_pg("pg_ctl"), "-D", str(_pgdata(stack)), "-m", "fast", "-w", "stop"])
        say("stopped postgres")
    _record(root).unlink()


def restart_prefect(stack: Stack) -> None:
    """Stop and start the Prefect server (an upgrade, a crash): running flow runs retry their calls meanwhile."""
    _stop(stack.pids["prefect"])
    _start_prefect(stack)
    _save(stack)
    _wait_http(f"{stack.prefect_api}/health", stack, "prefect")


def pause_deployment(client, name: str, timeout_s: float = 600) -> None:
    """Pause deployment `name` (e.g. `retrain/demo`) and wait until none of its flow runs is scheduled, pending or
    running: scheduled ones are cancelled, started ones are let finish (a cron run fired just before the pause
    would hold the pipeline's lock). StackError naming them after timeout_s."""
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelled

    deployment = client.read_deployment_by_name(name)
    client.pause_deployment(deployment.id)
    unfinished = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.CANCELLING, StateType.PAUSED]
    deadline = time.monotonic() + timeout_s
    while runs := client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])),
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=unfinished)))):
        for run in runs:
            if run.state_type == StateType.SCHEDULED:
                client.set_flow_run_state(run.id, Cancelled(message=f"deployment {name} paused"))
        if time.monotonic() > deadline:
            raise StackError(f"deployment {name} is paused, but after {timeout_s:.0f} s its flow runs "
                             f"{', '.join(f'{r.name} ({r.state_type.value})' for r in runs)} have not ended")
        time.sleep(2)


def _start_prefect(stack: Stack) -> None:
    database = f"postgresql+asyncpg://prefect:prefect@127.0.0.1:{stack.ports.postgres}/prefect"
    stack.pids["prefect"] = _start(stack, "prefect", [
        str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(stack.ports.prefect)], {
        "PREFECT_HOME": str(stack_dir(Path(stack.root)) / "prefect"), "PREFECT_API_DATABASE_CONNECTION_URL": database,
        "PREFECT_UI_API_URL": stack.prefect_api, **PREFECT_SERVER_ENV})


def stop_postgres(stack: Stack) -> None:
    """Stop PostgreSQL alone (a database lost under running servers); `up` starts it again."""
    _as_owner(stack, [_pg("pg_ctl"), "-D", str(_pgdata(stack)), "-m", "fast", "-w", "stop"])


def restart_postgres(stack: Stack) -> None:
    """Stop and start PostgreSQL (the fault a company sees on a database upgrade): clients must reconnect."""
    stop_postgres(stack)
    stack.pids["postgres"] = 0
    _postgres(stack, lambda _: None)
    _save(stack)


def _postgres(stack: Stack, say) -> None:
    if alive(stack.pids.get("postgres", 0)):
        return
    if shutil.which("pg_ctl") is None and not Path(_pg("pg_ctl")).exists():
        raise StackError("PostgreSQL's server is not installed (no pg_ctl): `apt-get install -y postgresql` "
                         "(Debian's package; .ci/run does this)")
    data = _pgdata(stack)
    folder = data.parent
    folder.mkdir(parents=True, exist_ok=True)
    if folder != stack_dir(Path(stack.root)) / "postgres":
        say(f"PostgreSQL's data: {folder} (the project folder is closed to `nobody`, who runs it under root)")
    if os.geteuid() == 0:  # initdb refuses to run as root: the cluster belongs to `nobody`
        owner = pwd.getpwnam("nobody")
        os.chown(folder, owner.pw_uid, owner.pw_gid)
    if not (data / "PG_VERSION").exists():
        say(f"initdb {data}")
        _as_owner(stack, [_pg("initdb"), "-D", str(data), "-U", SUPERUSER, "--auth=trust", "-E", "UTF8"])
    started = _as_owner(stack, [_pg("pg_ctl"), "-D", str(data), "-o",
                                f"-p {stack.ports.postgres} -k {folder} -h 127.0.0.1", "-l", str(folder / "log"),
                                "-w", "-t", "60", "start"], check=False)
    if started.returncode != 0:
        tail = (folder / "log").read_text()[-2000:] if (folder / "log").exists() else started.stderr
        raise StackError(f"PostgreSQL did not start on port {stack.ports.postgres} (taken? give another port "
                         f"with --postgres-port): {tail}")
    stack.pids["postgres"] = int((data / "postmaster.pid").read_text().split()[0])
    _databases(stack)


def _databases(stack: Stack) -> None:
    import psycopg2

    connection = psycopg2.connect(host="127.0.0.1", port=stack.ports.postgres, user=SUPERUSER, dbname="postgres")
    connection.autocommit = True  # CREATE DATABASE refuses a transaction block
    with connection.cursor() as cursor:
        for database, role in DATABASES.items():
            cursor.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,))
            if not cursor.fetchone():
                cursor.execute(f'CREATE ROLE "{role}" LOGIN PASSWORD %s', (role,))
            cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,))
            if not cursor.fetchone():
                cursor.execute(f'CREATE DATABASE "{database}" OWNER "{role}"')
    connection.close()


def _bucket(stack: Stack) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=stack.s3_endpoint, **{k.lower(): v for k, v in S3_CREDENTIALS.items()
                                                                if k != "AWS_DEFAULT_REGION"},
                      region_name=S3_CREDENTIALS["AWS_DEFAULT_REGION"])
    if BUCKET not in [b["Name"] for b in s3.list_buckets().get("Buckets", [])]:
        s3.create_bucket(Bucket=BUCKET)


def data_folder(stack: Stack) -> Path:
    """Where PostgreSQL keeps the stack's databases (kept by `down`)."""
    return _pgdata(stack).parent


def _pgdata(stack: Stack) -> Path:
    """The cluster's folder: .flywheel/stack/postgres/data, or, run as root where `nobody` (who owns the cluster:
    PostgreSQL refuses root) cannot reach the project (a 0700 home or /tmp/pytest-of-root), /var/tmp/."""
    folder = stack_dir(Path(stack.root)) / "postgres"
    if os.geteuid() == 0 and not _reachable_by_nobody(folder.parent):
        digest = hashlib.sha256(stack.root.encode()).hexdigest()[:12]
        folder = Path("/var/tmp") / f"flywheel-stack-{digest}" / "postgres"
    return folder / "data"


def _reachable_by_nobody(folder: Path) -> bool:
    folder.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["runuser", "-u", "nobody", "--", "test", "-x", str(folder)]).returncode == 0


def _pg(tool: str) -> str:
    found = shutil.which(tool)
    if found:
        return found
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin"))  # Debian's package keeps them off PATH
    return str(versions[-1] / tool) if versions else tool


def _as_owner(stack: Stack, command: list[str], check: bool = True) -> subprocess.CompletedProcess:
    if os.geteuid() == 0:
        command = ["runuser", "-u", "nobody", "--", *command]
    done = subprocess.run(command, capture_output=True, text=True, cwd="/")
    if check and done.returncode != 0:
        raise StackError(f"`{' '.join(command)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    return {**env, **extra}


def _start(stack: Stack, name: str, command: list[str], env: dict[str, str]) -> int:
    log = (stack_dir(Path(stack.root)) / "logs" / f"{name}.log").open("ab")
    process = subprocess.Popen(command, env=_env(env), cwd=stack.root, stdout=log, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    return process.pid


class _Pid:
    """A recorded pid as `serving` expects a process: poll() is None while it runs."""

    def __init__(self, pid: int):
        self.pid = pid

    def poll(self):
        return None if alive(self.pid) else 1


def _wait_http(url: str, stack: Stack, name: str, timeout_s: float = 180) -> None:
    if not serving(url, _Pid(stack.pids[name]), timeout_s):
        log = stack_dir(Path(stack.root)) / "logs" / f"{name}.log"
        raise StackError(f"{name} did not answer {url} (port taken?); the end of {log}:\n"
                         f"{log.read_text()[-2000:] if log.exists() else ''}")


def _wait_port(port: int, stack: Stack, name: str, timeout_s: float = 60) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if not alive(stack.pids[name]) or time.monotonic() > deadline:
                raise StackError(f"{name} did not listen on port {port} (taken?)") from None
            time.sleep(0.2)


def _stop(pid: int, timeout_s: float = 20) -> None:
    """SIGTERM the process group `pid` leads, then SIGKILL after timeout_s."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if alive(pid):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

