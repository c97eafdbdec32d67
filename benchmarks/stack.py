"""What the company stack costs and how fast it reacts: `flywheel stack` against the embedded default.

    .venv/bin/python benchmarks/stack.py [--quick]

In a new project (a temporary git repo with DVC and the small test pipeline, as the tests make it):
1. a fully cached `flywheel run small` with the embedded default (Prefect's temporary server, MLflow on SQLite),
   after one run that fills the caches;
2. the same on the stack (`flywheel stack up` on free ports: PostgreSQL, moto's S3, Prefect and MLflow servers on
   PostgreSQL, two process workers), the client pointed at it as `flywheel stack env` prints; `ratio` is the
   stack's cached run time over the embedded one's;
3. the pipeline deployed with a one-minute cron (`flywheel deploy --pool cpu-pool`): the delay from the first
   scheduled run's due time to its start on a worker;
4. a run whose process and workers are killed with SIGKILL 10 s after it started (after its first heartbeat),
   and no `flywheel status` after: the seconds until the stack's heartbeat automation marks it CRASHED.
Each run is timed as the command's wall time. The last line is one JSON object. `--quick`: parts 1 and 2 only,
with 5 SFT steps (the figures of 3 and 4 print as null). Every wait has a deadline: past it the benchmark stops,
saying what it waited for, and takes the stack down.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from _scratch import scratch  # benchmarks/ is the script's folder, first on sys.path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT / "tests"))  # the tests' project maker: the same small pipeline they run


def timed(command: list[str], cwd: Path, env: dict, timeout_s: float = 1200) -> float:
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        sys.exit(f"`{' '.join(command)}` did not end within {timeout_s:.0f} s")
    if done.returncode != 0:
        sys.exit(f"`{' '.join(command)}` failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="cached runs only, 5 SFT steps")
    args = parser.parse_args()

    from conftest import SMALL_PIPELINE, make_project
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
    from prefect.client.schemas.objects import StateType
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows import stack
    from flows.deployments import free_port
    from flows.runlock import lock_path

    work = scratch("bench-stack-")
    project = make_project(work / "project", work / "dvc-remote")
    pipeline = SMALL_PIPELINE + '    schedule: {cron: "* * * * *", timezone: UTC}\n'
    if args.quick:
        pipeline = pipeline.replace("sft: {steps: 60,", "sft: {steps: 5,")
    (project / "pipelines.yaml").write_text(pipeline)
    subprocess.run(["git", "-c", "user.name=b", "-c", "user.email=b@b", "commit", "-qam", "schedule"], cwd=project,
                   check=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    base |= {"PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONPATH": str(project),
             "PREFECT_HOME": str(work / "client-home")}
    run = [str(BIN / "flywheel"), "run", "small", "--no-push"]

    timed(run, project, base)  # fills the embedded caches
    embedded = timed(run, project, base)

    ports = [str(free_port()) for _ in range(4)]
    started = time.perf_counter()
    timed([str(BIN / "flywheel"), "stack", "up", "--prefect-port", ports[0], "--mlflow-port", ports[1],
           "--s3-port", ports[2], "--postgres-port", ports[3]], project, base)
    up_s = time.perf_counter() - started
    recorded = stack.load(project)
    env = base | recorded.client_env()
    result = {"benchmark": "stack", "quick": args.quick, "stack_up_s": round(up_s, 1)}
    try:
        timed(run, project, env)  # fills the stack's caches (its own MLflow and Prefect)
        on_stack = timed(run, project, env)
        result |= {"cached_run_embedded_s": round(embedded, 2), "cached_run_stack_s": round(on_stack, 2),
                   "ratio": round(on_stack / embedded, 3), "schedule_start_delay_s": None, "crash_marked_s": None}
        if not args.quick:
            with temporary_settings({PREFECT_API_URL: recorded.prefect_api}), \
                    get_client(sync_client=True) as client:
                timed([str(BIN / "flywheel"), "deploy", "--pool", stack.POOL], project, env)
                wanted = DeploymentFilter(name=DeploymentFilterName(any_=["small"]))
                deadline = time.monotonic() + 180
                while True:
                    runs = [r for r in client.read_flow_runs(deployment_filter=wanted)
                            if r.auto_scheduled and r.start_time is not None]
                    if runs:
                        break
                    if time.monotonic() > deadline:
                        sys.exit("no scheduled run started within 180 s")
                    time.sleep(1)
                first = min(runs, key=lambda r: r.expected_start_time)
                result["schedule_start_delay_s"] = round(
                    (first.start_time - first.expected_start_time).total_seconds(), 1)
                # paused, and every run the cron fired has ended: none holds the lock when the victim starts
                stack.pause_deployment(client, "retrain/small", timeout_s=600)

                victim = run_deployment("retrain/small", parameters={"refresh": True}, timeout=0)
                record = lock_path(project, "small")
                deadline = time.monotonic() + 300
                while str(victim.id) not in (record.read_text() if record.exists() else ""):
                    state = client.read_flow_run(victim.id).state
                    if state.is_final():
                        sys.exit(f"the victim run ended before taking the lock: {state.name} {state.message}")
                    if time.monotonic() > deadline:
                        sys.exit(f"the victim run did not take the lock within 300 s ({state.name})")
                    time.sleep(0.2)
                time.sleep(10)  # first heartbeat sent: a run killed before any is left to status (docs/operations.md)
                for name in [n for n in recorded.pids if n.startswith("worker-")]:
                    os.killpg(recorded.pids[name], signal.SIGKILL)
                os.kill(json.loads(record.read_text())["pid"], signal.SIGKILL)
                killed = time.monotonic()
                while (state := client.read_flow_run(victim.id).state).type != StateType.CRASHED:
                    if state.is_final():
                        sys.exit(f"the killed run was marked {state.name}, not CRASHED: {state.message}")
                    if time.monotonic() - killed > 600:
                        sys.exit(f"the killed run was not marked CRASHED within 600 s (still {state.name})")
                    time.sleep(1)
                result["crash_marked_s"] = round(time.monotonic() - killed, 1)
    finally:
        subprocess.run([str(BIN / "flywheel"), "stack", "down"], cwd=project, env=base, capture_output=True,
                       timeout=300)
        data = stack.data_folder(recorded)
        if data.parent.name.startswith("flywheel-stack-"):
            subprocess.run(["rm", "-rf", str(data.parent)])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
