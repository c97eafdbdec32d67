"""Deployments from pipelines.yaml: the retrain flow on each pipeline's schedule, the sensor on its trigger.

Names (flows/names.py): the retrain deployment of pipeline P is `retrain/P`, its sensor `watch-traces/P`;
deployed with job-per-stage, `stage/P` runs one stage of P as its own job. Every deployment made here is tagged
`flywheel`; a redeploy reconciles the server to the file: schedules are set to exactly what the file says,
and flywheel deployments the file no longer asks for are deleted.

- `serve(root)`: one process serves every deployment (Prefect's `serve`), on a real server: the ephemeral one
  has no scheduler, so `local_server` starts `prefect server start` under `.flywheel/prefect` when no
  PREFECT_API_URL is set.
- `deploy(root, pool)`: deployments on a work pool of a real server, code from the project root
  (`flow.from_source(root, ...)`; a process worker runs them in that folder: on each machine its own checkout at
  that path). With `stage_jobs` (from infra/k8s/stages.json) `retrain/P` starts each stage as a `stage/P` flow run
  with that stage's job variables, on its `work_queue`; the jobs need no shared folder (flows/stage.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from flows.names import ENTRYPOINTS, FLOWS, RETRAIN_FLOW, SENSOR_FLOW, STAGE_FLOW, deployment_name
from flywheel.config import PipelineConfig
from flywheel.errors import UserFacingError
from flywheel.settings import embedded_prefect_database, seed_prefect_database
from flywheel.stages import ORDER

TAG = "flywheel"
RESULTS_BLOCK = "flywheel-results"  # the RemoteFileSystem block that holds Prefect results on S3


def stage_job_variables(path: Path) -> dict[str, dict]:
    """Each stage's job variables from a file like infra/k8s/stages.json (keys other than stages are left out).

    A stage's `work_queue` is no job variable: its flow run goes to that queue of the pool (flows/stage.py), so
    that only the workers serving it (`prefect worker start --work-queue gpu` on a GPU machine) take the stage."""
    try:
        found = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise DeployError(f"{path}: cannot read the per-stage job variables ({err}); see infra/k8s/stages.json") \
            from None
    missing = [name for name in ORDER if not isinstance(found, dict) or not isinstance(found.get(name), dict)]
    if missing:
        raise DeployError(f"{path}: no job variables (an object) for stage(s) {', '.join(missing)}; give every "
                          f"stage of {', '.join(ORDER)} one ({{}} for the pool's defaults)")
    queues = [name for name in ORDER if not isinstance(found[name].get("work_queue", "default"), str)
              or not found[name].get("work_queue", "default")]
    if queues:
        raise DeployError(f"{path}: `work_queue` of stage(s) {', '.join(queues)} is not a queue name; give the "
                          "name of the pool's work queue the stage goes to (e.g. \"gpu\"), or leave it out")
    return {name: found[name] for name in ORDER}


@dataclass(frozen=True)
class Planned:
    """One deployment the file asks for: which flow, for which pipeline, on which schedules."""

    flow: str
    pipeline: str
    cron: tuple[str, str] | None = None  # (cron, timezone)
    every_s: int | None = None
    parameters: dict = field(default_factory=dict, compare=False)

    @property
    def full_name(self) -> str:
        return deployment_name(self.flow, self.pipeline)

    def schedules(self) -> list:
        from prefect.schedules import Cron, Interval

        if self.cron:
            return [Cron(self.cron[0], timezone=self.cron[1])]
        if self.every_s:
            return [Interval(self.every_s)]
        return []


def plan(pipelines: dict[str, PipelineConfig], root: Path, stage_jobs: dict[str, dict] | None = None
         ) -> list[Planned]:
    """What pipelines.yaml asks for: retrain/P if P has a schedule or a trigger, watch-traces/P if a trigger.

    With `stage_jobs` (stage -> job variables) retrain/P gets them as a parameter and stage/P is planned too.
    """
    wanted = []
    for name, cfg in sorted(pipelines.items()):
        parameters = {"pipeline": name, "root": str(root)}
        if cfg.schedule or cfg.trigger:
            cron = (cfg.schedule.cron, cfg.schedule.timezone) if cfg.schedule else None
            retrain_parameters = parameters | ({"stage_jobs": stage_jobs} if stage_jobs else {})
            wanted.append(Planned(RETRAIN_FLOW, name, cron=cron, parameters=retrain_parameters))
            if stage_jobs:
                wanted.append(Planned(STAGE_FLOW, name, parameters=parameters))
        if cfg.trigger:
            wanted.append(Planned(SENSOR_FLOW, name, every_s=cfg.trigger.every_s, parameters=parameters))
    return wanted


def _flow(name: str):
    # imported here, not above: the flows import Prefect and the stages, which `flywheel deploy --help` need not
    if name == RETRAIN_FLOW:
        from flows.retrain import retrain

        return retrain
    if name == STAGE_FLOW:
        from flows.stage import stage

        return stage
    from flows.sensor import watch_traces

    return watch_traces


def runner_deployments(wanted: list[Planned]) -> list:
    """The in-process deployments `flywheel serve` runs (the flows imported from this checkout)."""
    return [_flow(p.flow).to_deployment(name=p.pipeline, schedules=p.schedules(), parameters=p.parameters,
                                        tags=[TAG]) for p in wanted]


def deploy(root: Path, pool: str, wanted: list[Planned], job_variables: dict | None = None) -> dict:
    """Create or update the deployments on work pool `pool`, then reconcile; what was kept and deleted."""
    from prefect import Flow
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            raise DeployError(f"work pool '{pool}' does not exist on {client.api_url}: create it with "
                              f"`prefect work-pool create {pool} --type process` (or kubernetes, see "
                              "infra/README.md)") from None
    for planned in wanted:
        source = Flow.from_source(source=str(root), entrypoint=ENTRYPOINTS[planned.flow])
        deployment = source.to_deployment(name=planned.pipeline, parameters=planned.parameters, tags=[TAG],
                                          job_variables=job_variables or {}, schedules=planned.schedules())
        deployment.apply(work_pool_name=pool)
    return reconcile(wanted, pool, root)


class DeployError(UserFacingError, RuntimeError):
    """A deployment cannot be made; the message says what to do."""


def reconcile(wanted: list[Planned], pool: str | None, root: Path) -> dict:
    """Make the server hold exactly the file's deployments and schedules (this project's, in this pool or served)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterTags, FlowFilter, FlowFilterName

    by_name = {p.full_name: p for p in wanted}
    report = {"kept": [], "deleted": [], "schedules": {}}
    ours = FlowFilter(name=FlowFilterName(any_=list(FLOWS)))
    with get_client(sync_client=True) as client:
        flows = {f.id: f.name for f in client.read_flows(flow_filter=ours)}
        found = client.read_deployments(
            flow_filter=ours,
            deployment_filter=DeploymentFilter(tags=DeploymentFilterTags(all_=[TAG])))
        for deployment in found:
            full_name = f"{flows[deployment.flow_id]}/{deployment.name}"
            if deployment.work_pool_name != pool or (deployment.parameters or {}).get("root") != str(root):
                continue  # another pool's, served ones, or another checkout's: another deploy's business
            planned = by_name.get(full_name)
            if planned is None:
                client.delete_deployment(deployment.id)
                report["deleted"].append(full_name)
                continue
            report["kept"].append(full_name)
            report["schedules"][full_name] = _set_schedules(client, deployment.id, planned.schedules())
    return report


def _describe(schedule) -> str:
    if getattr(schedule, "cron", None):
        return f"cron {schedule.cron} {schedule.timezone or 'UTC'}"
    if getattr(schedule, "interval", None):
        return f"every {int(schedule.interval.total_seconds())}s"
    return str(schedule)


def _set_schedules(client, deployment_id, wanted: list) -> list[str]:
    """Leave exactly the wanted schedules on the deployment (an update can keep old ones); their descriptions."""
    from prefect.client.schemas.schedules import CronSchedule, IntervalSchedule

    objects = [CronSchedule(cron=s.cron, timezone=s.timezone) if s.cron else IntervalSchedule(interval=s.interval)
               for s in wanted]
    want = sorted(_describe(s) for s in objects)
    have = client.read_deployment_schedules(deployment_id)
    if sorted(_describe(s.schedule) for s in have) != want or not all(s.active for s in have):
        for schedule in have:
            client.delete_deployment_schedule(deployment_id, schedule.id)
        if objects:
            client.create_deployment_schedules(deployment_id, [(s, True) for s in objects])
    return want


def use_result_storage(url: str) -> str:
    """Keep Prefect task results (the stage caches) at an fsspec URL such as s3://bucket/prefect-results.

    Saved as the server's default result storage, so every run against this server (workers, `serve`) reads
    and writes cached results there: a stage cached on one machine is a cache hit on another. S3 settings come
    from the AWS_* variables of the process that runs the flow, never from the block.
    """
    from prefect.client.orchestration import get_client
    from prefect.filesystems import RemoteFileSystem

    block_id = RemoteFileSystem(basepath=url.rstrip("/")).save(RESULTS_BLOCK, overwrite=True)
    with get_client(sync_client=True) as client:
        client.update_server_default_result_storage(block_id)
    return f"remote-file-system/{RESULTS_BLOCK}"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def local_server(home: Path, port: int | None = None, timeout_s: float = 180):
    """`prefect server start` on SQLite under `home` (its PREFECT_HOME) on loopback; yields its API URL."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    home.mkdir(parents=True, exist_ok=True)
    seed_prefect_database(embedded_prefect_database(env))  # its template is kept by `flywheel run`'s first start
    log = (home / "server.log").open("ab")
    server = subprocess.Popen([str(Path(sys.executable).parent / "prefect"), "server", "start", "--host",
                               "127.0.0.1", "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        if not serving(f"{url}/health", server, timeout_s):
            raise RuntimeError(f"the Prefect server did not start on port {port}; see {home / 'server.log'}")
        yield url
    finally:
        stop_process_group(server)  # the server runs uvicorn in a child process
        log.close()


def serving(url: str, process: subprocess.Popen, timeout_s: float) -> bool:
    """Wait until `url` answers 200 (True), or the process exits or the timeout passes (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def stop_process_group(process: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 20) -> None:
    """Stop a process started with start_new_session=True and its children: `sig`, then SIGKILL after a wait."""
    if process.poll() is None:
        os.killpg(process.pid, sig)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
