"""One run of a pipeline at a time per project, and runs whose process died marked CRASHED / KILLED, not RUNNING.

Real components: fcntl locks between processes, Prefect's test server, MLflow on SQLite; the end-to-end test
runs `flywheel run` itself and kills it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from flows.runlock import PipelineBusy, lock_path, pipeline_lock, reap

BIN = Path(sys.executable).parent
HOLD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from flows.runlock import pipeline_lock
    with pipeline_lock(Path(sys.argv[1]), "p", sys.argv[2]) as holding:
        holding.record(mlflow_run_id=sys.argv[3])
        print("held", flush=True)
        time.sleep(600)
""")


def test_a_second_run_stops_naming_the_first_and_another_pipeline_is_free(tmp_path):
    with pipeline_lock(tmp_path, "p", "flow-1") as first:
        first.record(mlflow_run_id="run-1")
        with pytest.raises(PipelineBusy) as busy:
            with pipeline_lock(tmp_path, "p"):
                pass
        message = str(busy.value)
        assert message.startswith(f"pipeline 'p' is already running (pid {os.getpid()} on ")
        assert "Prefect flow run flow-1, MLflow run run-1" in message and "--wait" in message
        with pipeline_lock(tmp_path, "q"):
            pass
        assert [(f.pipeline, f.running, f.holder["flow_run_id"]) for f in reap(tmp_path)] == [("p", True, "flow-1")]
    assert reap(tmp_path) == [], "a run that ended clears its record"
    assert lock_path(tmp_path, "p").read_text() == ""


def test_a_failing_run_clears_its_record_and_wait_starts_when_the_holder_ends(tmp_path, capsys):
    with pytest.raises(ValueError):
        with pipeline_lock(tmp_path, "p"):
            raise ValueError("a stage failed")  # the flow reports FAILED itself: nothing left to mark
    assert reap(tmp_path) == []

    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with pipeline_lock(tmp_path, "p", "flow-first"):
            held.set()
            release.wait(30)

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait(30)
    threading.Timer(1.5, release.set).start()
    began = time.monotonic()
    with pipeline_lock(tmp_path, "p", "flow-second", wait=True) as second:
        waited = time.monotonic() - began
        assert json.loads(lock_path(tmp_path, "p").read_text())["flow_run_id"] == "flow-second"
        assert second.holder["flow_run_id"] == "flow-second"
    thread.join()
    assert waited >= 1.0
    assert "waiting for the running 'p' run to finish (pid" in capsys.readouterr().out


def test_a_killed_holder_is_found_and_its_runs_marked_crashed_and_killed(tmp_path, prefect_server, mlflow_store):
    from prefect import flow, get_client
    from prefect.states import Running

    @flow(name="runlock-victim")
    def victim() -> None:
        pass

    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(victim, state=Running())
    c = MlflowClient()
    experiment = c.create_experiment("p")
    parent = c.create_run(experiment).info.run_id
    child = c.create_run(experiment, tags={"mlflow.parentRunId": parent}).info.run_id

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path), str(flow_run.id), parent], env=env,
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    [found] = reap(tmp_path)
    assert found.running and found.holder["pid"] == process.pid
    process.send_signal(signal.SIGKILL)
    process.wait()

    [found] = reap(tmp_path)
    assert not found.running
    assert found.marked == [f"Prefect flow run {flow_run.id} Running -> CRASHED",
                            f"MLflow run {parent} RUNNING -> KILLED", f"MLflow run {child} RUNNING -> KILLED"]
    assert f"the run pid {process.pid} on" in found.line() and "died without finishing" in found.line()
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run.id).state
    assert state.type.value == "CRASHED" and f"pid {process.pid}" in state.message
    assert {c.get_run(r).info.status for r in (parent, child)} == {"KILLED"}
    assert reap(tmp_path) == [], "marked once: the record is cleared"


@pytest.mark.slow
def test_flywheel_run_twice_then_terminated(project, prefect_server):
    """The second `flywheel run` stops naming the first; the first, SIGTERMed, ends CRASHED through Prefect itself,
    its MLflow run FAILED, and after `flywheel status` none of its MLflow runs is left RUNNING."""
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PYTHONPATH": str(project), "PATH": f"{BIN}:{os.environ['PATH']}", "COLUMNS": "200",
           "PREFECT_API_URL": PREFECT_API_URL.value()}
    record = lock_path(project, "small")

    def start() -> tuple[subprocess.Popen, dict]:
        process = subprocess.Popen([str(BIN / "flywheel"), "run", "small", "--no-push"], cwd=project, env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 180
        while True:  # running once its record names its MLflow run
            holder = json.loads(record.read_text() or "{}") if record.exists() else {}
            if holder.get("pid") == process.pid and holder.get("mlflow_run_id"):
                return process, holder
            assert process.poll() is None and time.monotonic() < deadline, "the run ended before taking its lock"
            time.sleep(0.2)

    def flywheel(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "flywheel"), *args], cwd=project, env=env, capture_output=True, text=True,
                              timeout=300)

    def flow_state(holder: dict):
        with get_client(sync_client=True) as client:
            return client.read_flow_run(holder["flow_run_id"]).state

    first, holder = start()
    second = flywheel("run", "small", "--no-push")
    assert second.returncode == 1, second.stdout + second.stderr
    assert f"error: pipeline 'small' is already running (pid {first.pid} on " in second.stdout + second.stderr
    # a SIGKILLed `flywheel run`, found by `flywheel status`: tests/test_stack.py (the same record, on the stack)
    os.killpg(first.pid, signal.SIGTERM)
    first.wait(timeout=120)
    assert flow_state(holder).type.value == "CRASHED", "Prefect reports a SIGTERM itself"
    assert MlflowClient().get_run(holder["mlflow_run_id"]).info.status == "FAILED"
    status = flywheel("status", "small")
    # a stage's MLflow run the signal cut before it could end is marked here; none is left RUNNING
    assert f"small: the run pid {first.pid} on" in status.stdout, status.stdout
    experiment = MlflowClient().get_experiment_by_name("small").experiment_id
    assert [r.info.status for r in MlflowClient().search_runs([experiment]) if r.info.status == "RUNNING"] == []
    assert reap(project) == []
