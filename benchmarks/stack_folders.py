"""Stage jobs on two workers that share no folder, against one run in one folder: same bytes, what it costs.

    .venv/bin/python benchmarks/stack_folders.py [--quick]

Two machines as one machine can make them: `flywheel stack up --workers 0` in machine 1's checkout (PostgreSQL,
moto's S3, the Prefect and MLflow servers) and two process workers on its pool `cpu-pool`, each in its own clone of
the project at the same path, as two machines would hold it. Machine 1 is the checkout itself and serves the pool's
`default` queue (the retrain flow, collect, synthesize, register); machine 2 runs in a private mount namespace
(`unshare -m`, hence root) where a second clone is mounted over that path (and a /var/tmp of its own over
/var/tmp), and serves the `gpu` queue (sft, rl and evaluate: their `work_queue` in infra/k8s/stages.json). Neither
sees the other's files: they share only the stack (DVC's S3 remote, Prefect's results in S3, the MLflow server).
1. `flywheel deploy --job-per-stage --results s3://...`; retrain/small runs; which worker took each stage.
2. The same pipeline in one folder with the embedded defaults (`flywheel run small`). A fresh clone of the
   deployed checkout (its dvc.lock committed) runs `dvc pull`: `dvc status` is clean but for register's
   uncached record, and every file of every dataset and model has the one-folder run's md5 (the eval table
   compared without its measured latency column; registration.json names another registry's version).
3. Machine 2's folder and DVC cache emptied (a new machine) and retrain/small run again: every stage cached,
   its outputs pulled where it ran, none run again.
Fails (exit 1) if any of that does not hold. The last line is one JSON object: where the stages ran, the files
compared, the wall time of each run. `--quick`: 5 SFT steps.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT / "tests"))  # the tests' project maker: the same small pipeline they run
WORKER_QUEUES = {"machine-1": "default", "machine-2": "gpu"}


def run(command: list[str], cwd: Path, env: dict, timeout_s: float = 900) -> str:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        sys.exit(f"`{' '.join(command)}` failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def git(cwd: Path, *args: str) -> str:
    return run(["git", "-c", "user.name=b", "-c", "user.email=b@b", *args], cwd, dict(os.environ))


def md5s(project: Path, pipeline: str) -> dict[str, str]:
    """md5 of every file of the pipeline's datasets and models, less the checkpoints a run removes when it ends
    and registration.json; the eval table without its latency column (measured, so never equal)."""
    import pandas as pd

    found = {}
    for folder in (f"data/{pipeline}", f"models/{pipeline}"):
        for path in sorted((project / folder).rglob("*")):
            if not path.is_file() or "checkpoints" in str(path) or path.name == "registration.json":
                continue
            if path.name == "eval.parquet":
                table = pd.read_parquet(path)
                data = table.drop(columns=["latency_s"]).to_json(orient="records").encode()
            else:
                data = path.read_bytes()
            found[str(path.relative_to(project))] = hashlib.md5(data).hexdigest()
    return found


def retrain(client, logs: dict[str, Path], timeout_s: float) -> tuple[object, float, dict[str, str]]:
    """retrain/small on the pool, waited for: (its summary, wall seconds, stage -> the worker that ran it)."""
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.deployments import run_deployment
    from test_servers import _final  # a flow run's final state, with a deadline

    started = time.perf_counter()
    flow_run = run_deployment("retrain/small", timeout=0)
    final = _final(client, flow_run.id, timeout_s)
    took = time.perf_counter() - started
    if not final.state.is_completed():
        sys.exit(f"retrain/small ended {final.state.name}: {final.state.message}\n"
                 + "\n".join(f"--- {name}:\n{log.read_text()[-3000:]}" for name, log in logs.items()))
    stage_runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["stage"])),
                                       flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(
                                           any_=[flow_run.id])))
    text = {name: log.read_text() for name, log in logs.items()}
    ran_on = {}
    for stage_run in stage_runs:
        [worker] = [name for name in logs if str(stage_run.id) in text[name]] or ["?"]
        if stage_run.work_queue_name != WORKER_QUEUES.get(worker):
            sys.exit(f"stage {stage_run.parameters['name']} went to queue {stage_run.work_queue_name} and ran on "
                     f"{worker}")
        ran_on[stage_run.parameters["name"]] = worker
    return final.state.result(), took, ran_on


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 SFT steps")
    parser.add_argument("--keep", action="store_true", help="keep the folders and the workers' logs")
    args = parser.parse_args()

    from conftest import SMALL_PIPELINE, make_project
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows import stack
    from flows.deployments import free_port, stop_process_group
    from flywheel.stages import ORDER

    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        sys.exit("`unshare -m` is refused here: machine 2's private mount namespace needs root (CAP_SYS_ADMIN)")
    work = Path(tempfile.mkdtemp(prefix="bench-folders-"))
    project = make_project(work / "project", work / "unused-remote")  # machine 1's checkout, and the deploy root
    pipeline = SMALL_PIPELINE + '    schedule: {cron: "0 3 1 1 *", timezone: UTC}\n'
    if args.quick:
        pipeline = pipeline.replace("sft: {steps: 60,", "sft: {steps: 5,")
    (project / "pipelines.yaml").write_text(pipeline)
    run([sys.executable, "-m", "dvc", "remote", "add", "-d", "team", f"s3://{stack.BUCKET}/dvc"], project,
        dict(os.environ))
    git(project, "commit", "-qam", "the team's S3 remote; a schedule")
    machine2 = work / "machine-2"
    git(work, "clone", "-q", str(project), str(machine2))

    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "AWS_"))}
    base |= {"PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONPATH": str(project), "OMP_NUM_THREADS": "1"}
    ports = [str(free_port()) for _ in range(4)]
    started = time.perf_counter()
    run([str(BIN / "flywheel"), "stack", "up", "--workers", "0", "--prefect-port", ports[0], "--mlflow-port",
         ports[1], "--s3-port", ports[2], "--postgres-port", ports[3]], project, base)
    up_s = time.perf_counter() - started
    recorded = stack.load(project)
    env = base | recorded.client_env() | {"PREFECT_HOME": str(work / "client-home")}
    os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})  # this process reads results in S3
    workers, logs, done = [], {}, False
    try:
        for name, queue in WORKER_QUEUES.items():
            command = [str(BIN / "prefect"), "worker", "start", "--pool", stack.POOL, "--type", "process",
                       "--work-queue", queue, "--name", name]
            home = work / f"{name}-home"  # each machine's own home (caches) and Prefect home
            if name == "machine-2":  # its own clone mounted over the project's path, its own /var/tmp (DVC's
                # state and index, keyed by the repo's path), where only it sees them
                (home / "var-tmp").mkdir(parents=True)
                command = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                           'mount --bind "$1" "$2" && mount --bind "$3" /var/tmp && cd "$2" && shift 3 && exec "$@"',
                           "sh", str(machine2), str(project), str(home / "var-tmp"), *command]
            logs[name] = work / f"{name}.log"
            with logs[name].open("wb") as log:
                workers.append(subprocess.Popen(
                    command, cwd=project, env=env | stack.WORKER_ENV | {"HOME": str(home),
                                                                        "PREFECT_HOME": str(home / "prefect")},
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        run([str(BIN / "flywheel"), "deploy", "--pool", stack.POOL, "--root", str(project), "--job-per-stage",
             "--results", f"s3://{stack.BUCKET}/prefect-results", "--stage-variables",
             str(ROOT / "infra/k8s/stages.json")], project, env)
        with temporary_settings({PREFECT_API_URL: recorded.prefect_api}), get_client(sync_client=True) as client:
            summary, two_folder_s, ran_on = retrain(client, logs, 900)
            if sorted(ran_on) != sorted(ORDER) or set(ran_on.values()) != set(WORKER_QUEUES):
                sys.exit(f"the stages ran on {ran_on}: not every stage, or not on both workers")
            if (project / "models/small/sft").exists() or (machine2 / "data/small/register").exists():
                sys.exit("a worker's folder holds what only the other one made: the folders are shared")

            # the one-folder run, embedded; then the deployed run's outputs as its dvc.lock records them
            single = work / "single"
            git(work, "clone", "-q", str(project), str(single))
            started = time.perf_counter()
            run([str(BIN / "flywheel"), "run", "small", "--no-push", "--root", str(single)], single,
                base | {"PYTHONPATH": str(single), "PREFECT_HOME": str(work / "single-home")})
            one_folder_s = time.perf_counter() - started
            git(project, "add", "dvc.lock")
            git(project, "commit", "-qm", "the deployed run's data")
            fresh = work / "fresh"
            git(work, "clone", "-q", str(project), str(fresh))
            run([sys.executable, "-m", "dvc", "pull"], fresh, env)
            unclean = set(json.loads(run([sys.executable, "-m", "dvc", "status", "--json"], fresh, env) or "{}"))
            if unclean - {"register@small"}:
                sys.exit(f"`dvc status` in a clone that pulled the deployed run's dvc.lock: {sorted(unclean)}")
            ours, theirs = md5s(fresh, "small"), md5s(single, "small")
            differ = sorted(p for p in ours.keys() | theirs.keys() if ours.get(p) != theirs.get(p))
            if differ or not ours:
                sys.exit(f"the two-folder run's outputs differ from the one-folder run's: {differ[:20]}")

            # machine 2 replaced by a new one: nothing in its folder, nothing in its DVC cache
            for gone in ("data", "models", ".dvc/cache"):
                shutil.rmtree(machine2 / gone, ignore_errors=True)
            cached, cached_s, cached_on = retrain(client, logs, 900)
            if cached.ran or not (machine2 / "models/small/rl").exists():
                sys.exit(f"the rerun on a new machine 2 ran {cached.ran} (every stage should be cached, its outputs "
                         "pulled)")
        done = True
        result = {"benchmark": "stack_folders", "quick": args.quick, "stack_up_s": round(up_s, 1),
                  "stages_on": ran_on, "files_identical": len(ours), "two_folder_run_s": round(two_folder_s, 1),
                  "one_folder_run_s": round(one_folder_s, 1), "ratio": round(two_folder_s / one_folder_s, 2),
                  "cached_rerun_s": round(cached_s, 1), "cached_rerun_ran": cached.ran}
    finally:
        for worker in workers:
            stop_process_group(worker)
        subprocess.run([str(BIN / "flywheel"), "stack", "down"], cwd=project, env=base, capture_output=True)
        data = stack.data_folder(recorded)
        if data.parent.name.startswith("flywheel-stack-"):
            shutil.rmtree(data.parent, ignore_errors=True)
        if done and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"the folders and the workers' logs are kept in {work}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
