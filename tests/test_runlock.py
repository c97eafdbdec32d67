"""One run of a pipeline at a time per project; a run stopped or killed leaves no process running and no run
RUNNING (flows/runlock.py, flows/processes.py, `flywheel run`).

Real components: fcntl locks between processes, Prefect's test server, MLflow on SQLite; the end-to-end tests run
`flywheel run` itself (its own temporary Prefect server, in the project's .flywheel/prefect) and signal it."""

from __future__ import annotations

import filecmp
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
from mlflow import MlflowClient

from flows.processes import RUN_MARK
from flows.runlock import PipelineBusy, lock_path, pipeline_lock, reap
from flywheel.settings import prefect_template_dir

BIN = Path(sys.executable).parent
HOLD = textwrap.dedent("""
    import subprocess, sys, time
    from pathlib import Path
    from flows.runlock import pipeline_lock
    with pipeline_lock(Path(sys.argv[1]), sys.argv[2], sys.argv[3]) as holding:
        holding.record(mlflow_run_id=sys.argv[4])
        if len(sys.argv) > 5:  # a child it starts (it carries the run's mark), and a pid it claims as its server
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            holding.record(server_pid=int(sys.argv[5]), server_port=8123)
            print(child.pid, flush=True)
        print("held", flush=True)
        time.sleep(600)
""")
WAIT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from flows.runlock import pipeline_lock
    with pipeline_lock(Path(sys.argv[1]), sys.argv[2], sys.argv[3], wait=True):
        time.sleep(600)
""")


def _python(script: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen([sys.executable, "-c", script, *args], env=env, stdout=subprocess.PIPE, text=True)


def _until(check, what: str, timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return found


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _in_thread(fn) -> BaseException | None:
    """What fn raised in another thread (the lock is re-entrant within its holder's thread)."""
    raised = []

    def call() -> None:
        try:
            fn()
        except BaseException as err:
            raised.append(err)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join(30)
    return raised[0] if raised else None


def _take(root: Path, pipeline: str) -> None:
    with pipeline_lock(root, pipeline):
        pass


def test_a_second_run_stops_naming_the_first_and_the_holders_flow_runs_under_its_hold(tmp_path):
    with pipeline_lock(tmp_path, "p") as first:
        first.record(mlflow_run_id="run-1")
        with pipeline_lock(tmp_path, "p", "flow-1") as again:  # the flow under `flywheel run`'s hold
            assert again is first and first.holder["flow_run_id"] == "flow-1"
        busy = _in_thread(lambda: _take(tmp_path, "p"))
        assert isinstance(busy, PipelineBusy)
        message = str(busy)
        assert message.startswith(f"pipeline 'p' is already running (pid {os.getpid()} on ")
        assert "Prefect flow run flow-1, MLflow run run-1" in message and "--wait" in message
        assert _in_thread(lambda: _take(tmp_path, "q")) is None, "another pipeline is free"
        assert os.environ[RUN_MARK] == first.holder["mark"], "what the run starts carries its mark"
        assert [(f.pipeline, f.state, f.holder["flow_run_id"]) for f in reap(tmp_path)] == [("p", "running", "flow-1")]
    assert RUN_MARK not in os.environ
    assert reap(tmp_path) == [], "a run that ended clears its record"
    assert lock_path(tmp_path, "p").read_text() == ""


def test_a_failing_run_clears_its_record_and_a_waiter_records_itself_until_the_holder_ends(tmp_path, capsys):
    with pytest.raises(ValueError):
        with pipeline_lock(tmp_path, "p"):
            raise ValueError("a stage failed")  # the flow reports FAILED itself: nothing left to mark
    assert reap(tmp_path) == []

    def second() -> None:
        with pipeline_lock(tmp_path, "p", "flow-second", wait=True) as holding:
            assert json.loads(lock_path(tmp_path, "p").read_text())["flow_run_id"] == "flow-second"
            assert holding.holder["flow_run_id"] == "flow-second"

    with pipeline_lock(tmp_path, "p", "flow-first"):
        outcome: list = []
        thread = threading.Thread(target=lambda: outcome.append(_in_thread(second)))
        thread.start()
        waiting = _until(lambda: [f for f in reap(tmp_path) if f.state == "waiting"], "the waiting record")
    thread.join(30)
    assert outcome == [None], "the waiter ran once the holder ended"
    [waiter] = waiting
    assert waiter.holder["flow_run_id"] == "flow-second" and "waiting for the running one" in waiter.line()
    assert "waiting for the running 'p' run to finish (pid" in capsys.readouterr().out
    assert list((tmp_path / ".flywheel/locks").iterdir()) == [lock_path(tmp_path, "p")], "the waiter's record went"


def _victim_runs(name: str) -> tuple[str, str, str]:
    """A Prefect flow run in state Running, and an MLflow parent run with one child, both RUNNING."""
    from prefect import flow, get_client
    from prefect.states import Running

    @flow(name=name)
    def victim() -> None:
        pass

    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(victim, state=Running())
    c = MlflowClient()
    experiment = c.create_experiment(name)
    parent = c.create_run(experiment).info.run_id
    child = c.create_run(experiment, tags={"mlflow.parentRunId": parent}).info.run_id
    return str(flow_run.id), parent, child


def _flow_state(flow_run_id: str) -> str:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).state.type.value


def test_a_killed_holder_is_marked_once_prefect_answers_and_its_record_stays_until_then(
        tmp_path, prefect_server, mlflow_store):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    flow_run, parent, child = _victim_runs("runlock-victim")
    process = _python(HOLD, str(tmp_path), "p", flow_run, parent)
    assert process.stdout.readline().strip() == "held"
    [found] = reap(tmp_path)
    assert found.running and found.holder["pid"] == process.pid
    process.send_signal(signal.SIGKILL)
    process.wait()

    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):  # nothing listens there
        [found] = reap(tmp_path)
    assert found.state == "dead" and not found.settled
    assert f"Prefect flow run {flow_run} could not be marked (ConnectError" in found.marked[0]
    assert found.marked[1:] == [f"MLflow run {parent} RUNNING -> KILLED", f"MLflow run {child} RUNNING -> KILLED"]
    assert "the next check tries again" in found.line()
    assert _flow_state(flow_run) == "RUNNING"
    assert [p.suffix for p in (tmp_path / ".flywheel/locks").iterdir() if p.suffix != ".lock"] == [".dead"]

    [found] = reap(tmp_path)
    assert found.settled and found.marked == [f"Prefect flow run {flow_run} Running -> CRASHED"]
    assert f"the run pid {process.pid} on" in found.line() and "died without finishing" in found.line()
    from prefect import get_client

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run).state
    assert state.type.value == "CRASHED" and f"pid {process.pid}" in state.message
    assert {MlflowClient().get_run(r).info.status for r in (parent, child)} == {"KILLED"}
    assert reap(tmp_path) == [], "marked once: the record is gone"
    assert [p.name for p in (tmp_path / ".flywheel/locks").iterdir()] == ["p.lock"]


def test_a_killed_waiter_with_a_flow_run_is_marked_crashed(tmp_path, prefect_server, mlflow_store):
    flow_run, parent, _ = _victim_runs("runlock-holder")
    waiter_run, _, _ = _victim_runs("runlock-waiter")
    holder = _python(HOLD, str(tmp_path), "p", flow_run, parent)
    assert holder.stdout.readline().strip() == "held"
    waiter = _python(WAIT, str(tmp_path), "p", waiter_run)
    try:
        assert waiter.stdout.readline().startswith("waiting for the running 'p' run to finish")
        [found] = _until(lambda: [f for f in reap(tmp_path) if f.state == "waiting"], "the waiting record")
        assert found.holder["pid"] == waiter.pid and found.holder["flow_run_id"] == waiter_run
        waiter.send_signal(signal.SIGKILL)
        waiter.wait()
        dead = [f for f in reap(tmp_path) if f.state == "dead"]
        assert [(f.holder["pid"], f.marked, f.settled) for f in dead] == [
            (waiter.pid, [f"Prefect flow run {waiter_run} Running -> CRASHED"], True)]
        assert "a run waiting to start (pid" in dead[0].line()
        assert _flow_state(waiter_run) == "CRASHED" and _flow_state(flow_run) == "RUNNING"
        assert [f.state for f in reap(tmp_path)] == ["running"]
    finally:
        holder.kill()
        holder.wait()


def test_a_dead_run_leaves_no_process_and_a_reused_pid_is_not_killed(tmp_path, mlflow_store):
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # not a Prefect server
    process = _python(HOLD, str(tmp_path), "p", "", "", str(stranger.pid))
    try:
        child = int(process.stdout.readline())
        assert process.stdout.readline().strip() == "held"
        process.send_signal(signal.SIGKILL)
        process.wait()
        assert not _gone(child), "a SIGKILL leaves the run's children running"
        [found] = reap(tmp_path, mark=False)
        assert found.state == "dead" and found.marked == [f"stopped 1 process it started (pid {child})"]
        assert _gone(child)
        assert stranger.poll() is None, "the recorded server pid runs something else now: left alone"
        [again] = reap(tmp_path)
        assert again.settled and again.marked == [] and reap(tmp_path) == []
    finally:
        stranger.kill()
        stranger.wait()


# ---- `flywheel run` itself --------------------------------------------------------------------------------------

def _env(project: Path, **extra: str) -> dict:
    """The command's environment: the project's own Prefect home (its temporary server) and result storage."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PREFECT_API_URL", "PREFECT_HOME", "PREFECT_RESULTS_LOCAL_STORAGE_PATH")}
    return env | {"PYTHONPATH": str(project), "PATH": f"{BIN}:{os.environ['PATH']}", "COLUMNS": "200"} | extra


def _start(project: Path, *args: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen([str(BIN / "flywheel"), "run", "small", "--no-push", *args], cwd=project,
                            env=_env(project, **env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _running(project: Path, process: subprocess.Popen) -> tuple[dict, list[psutil.Process]]:
    """Once the run's record names its server and MLflow run: the record, and every process of the run."""
    record = lock_path(project, "small")

    def recorded() -> dict:
        holder = json.loads(record.read_text() or "{}") if record.exists() else {}
        assert process.poll() is None, process.communicate()
        return holder if holder.get("pid") == process.pid and holder.get("mlflow_run_id") else {}

    holder = _until(recorded, "the run to record its MLflow run", timeout_s=240)
    assert holder["server_pid"] in [p.pid for p in psutil.Process(process.pid).children()]
    return holder, [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]


def _flywheel(project: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "flywheel"), *args], cwd=project, env=_env(project, **env), capture_output=True,
                          text=True, timeout=300)


def _flow_runs(project: Path) -> dict[str, str]:
    """Every flow run in the project's own Prefect database, and its state."""
    with sqlite3.connect(project / ".flywheel/prefect/prefect.db") as db:
        return dict(db.execute("SELECT id, state_type FROM flow_run").fetchall())


def _mlflow_running() -> list[str]:
    c = MlflowClient()
    experiment = c.get_experiment_by_name("small").experiment_id
    return [r.info.run_id for r in c.search_runs([experiment]) if r.info.status == "RUNNING"]


def _left(project: Path, processes: list[psutil.Process]) -> list[str]:
    """Processes of the run still running: those seen while it ran, and any carrying the project's Prefect home."""
    home = f"PREFECT_HOME={project / '.flywheel/prefect'}"
    left = []
    for process in psutil.process_iter():
        try:
            if process.status() != psutil.STATUS_ZOMBIE and (
                    any(p.pid == process.pid and p.create_time() == process.create_time() for p in processes)
                    or home in [f"{k}={v}" for k, v in process.environ().items()]):
                left.append(" ".join(process.cmdline()))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return left


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM to the process", "Ctrl-C (SIGINT to its process group)"])
def test_flywheel_run_refuses_a_second_run_at_once_and_a_signal_stops_everything(project, how):
    """A second `flywheel run` stops within 10 s naming the first's pid, flow run and MLflow run, and makes no flow
    run; the first, stopped, says so in one line, ends CRASHED in Prefect and KILLED in MLflow, and leaves no
    process and no record."""
    first = _start(project)
    holder, processes = _running(project, first)
    began = time.monotonic()
    second = _flywheel(project, "run", "small", "--no-push")
    assert time.monotonic() - began < 10
    assert second.returncode == 1, second.stdout + second.stderr
    [error] = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith(f"error: pipeline 'small' is already running (pid {first.pid} on ")
    assert f"Prefect flow run {holder['flow_run_id']}, MLflow run {holder['mlflow_run_id']}" in error
    assert list(_flow_runs(project)) == [holder["flow_run_id"]], "the refused run made no flow run"

    if how.startswith("SIGTERM"):
        os.kill(first.pid, signal.SIGTERM)
    else:
        os.killpg(first.pid, signal.SIGINT)
    _, err = first.communicate(timeout=120)
    name = "SIGTERM" if how.startswith("SIGTERM") else "SIGINT"
    assert first.returncode == 128 + getattr(signal, name), err
    assert [line for line in err.splitlines() if "stopped" in line] == [
        f"flywheel run small: stopped by {name}: Prefect flow run {holder['flow_run_id']} CRASHED, MLflow run "
        f"{holder['mlflow_run_id']} KILLED"], err
    assert _flow_runs(project) == {holder["flow_run_id"]: "CRASHED"}
    assert MlflowClient().get_run(holder["mlflow_run_id"]).info.status == "KILLED"
    assert _mlflow_running() == []
    assert _left(project, processes) == []
    assert reap(project) == [] and lock_path(project, "small").read_text() == ""


@pytest.mark.slow
def test_a_killed_run_is_cleaned_up_by_the_next_commands_even_with_prefect_unreachable_at_first(project):
    """SIGKILL leaves the run's Prefect server running and its runs RUNNING. `flywheel status` with Prefect
    unreachable stops the server and marks MLflow, keeping the record; the next `flywheel run` marks the flow run
    CRASHED (and is then stopped itself)."""
    first = _start(project)
    holder, processes = _running(project, first)
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    assert not _gone(holder["server_pid"]), "a SIGKILL leaves the server behind: the next command ends it"
    assert _left(project, processes), "what it left is seen"

    status = _flywheel(project, "status", "small", PREFECT_API_URL="http://127.0.0.1:9/api")
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"small: the run pid {first.pid} on" in status.stdout
    assert f"stopped its Prefect server (pid {holder['server_pid']})" in status.stdout
    assert f"Prefect flow run {holder['flow_run_id']} could not be marked" in status.stdout
    assert "its record is kept" in status.stdout
    assert _gone(holder["server_pid"]) and _left(project, processes) == []
    assert _mlflow_running() == []
    assert _flow_runs(project)[holder["flow_run_id"]] == "RUNNING"
    assert [f.state for f in reap(project, mark=False)] == ["dead"], "the record stays until Prefect is marked"

    second = _start(project)
    holder2, processes2 = _running(project, second)  # its flow marked the dead run before its own MLflow run
    assert _flow_runs(project)[holder["flow_run_id"]] == "CRASHED"
    assert not list((project / ".flywheel/locks").glob("*.dead"))
    os.kill(second.pid, signal.SIGTERM)
    _, err = second.communicate(timeout=120)
    assert second.returncode == 143, err
    assert _flow_runs(project) == {holder["flow_run_id"]: "CRASHED", holder2["flow_run_id"]: "CRASHED"}
    assert _mlflow_running() == [] and _left(project, processes + processes2) == []
    assert reap(project) == []


def test_a_killed_or_stopped_waiter_leaves_nothing(project, mlflow_store):
    holder = _python(HOLD, str(project), "small", "", "")
    assert holder.stdout.readline().strip() == "held"
    try:
        for sig in (signal.SIGKILL, signal.SIGTERM):
            waiter = _start(project, "--wait")
            assert waiter.stdout.readline().startswith(f"waiting for the running 'small' run to finish (pid "
                                                       f"{holder.pid}")
            [found] = _until(lambda: [f for f in reap(project) if f.state == "waiting"], "the waiting record")
            assert found.holder["pid"] == waiter.pid
            os.kill(waiter.pid, sig)
            _, err = waiter.communicate(timeout=60)
            if sig == signal.SIGTERM:
                assert waiter.returncode == 143
                assert "flywheel run small: stopped by SIGTERM: nothing was started" in err
                assert [f.state for f in reap(project)] == ["running"]
            else:
                dead = [f for f in reap(project) if f.state == "dead"]
                assert [(f.holder["pid"], f.settled) for f in dead] == [(waiter.pid, True)]
                assert "it had started nothing" in dead[0].line()
        assert sorted(p.name for p in (project / ".flywheel/locks").iterdir()) == ["small.lock"]
        # a waiter starts no Prefect server: the project's database, if any, is the template's copy, never opened
        database = project / ".flywheel/prefect/prefect.db"
        assert not database.exists() or (
            filecmp.cmp(database, prefect_template_dir() / "prefect.db", shallow=False)
            and not list(database.parent.glob("prefect.db-*"))), "a waiter starts no Prefect server"
    finally:
        holder.kill()
        holder.wait()


def test_prefect_server_start_timing_out_says_what_to_set(project):
    failed = _flywheel(project, "run", "small", "--no-push", PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="1")
    assert failed.returncode == 1
    [error] = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith("error: Prefect's temporary server did not answer within 1 s")
    assert "set PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS higher" in error and "PREFECT_API_URL" in error
    assert "bug" not in failed.stderr
    assert _left(project, []) == [] and reap(project) == []


def test_a_run_in_a_longer_lived_process_stops_what_it_started_and_spares_what_ran_before(tmp_path):
    """`flywheel run` called in a process that already runs children of its own (a notebook's server, the test
    session's Prefect server): its failure ends what it started, never those."""
    import yaml
    from typer.testing import CliRunner

    from flywheel.cli import app

    demo = yaml.safe_load((Path(__file__).resolve().parent.parent / "pipelines.yaml").read_text())["pipelines"]["demo"]
    demo["student"] |= {"tiny": {"max_position_embeddings": 64}}  # the prompt does not fit: the checks fail
    (tmp_path / "pipelines.yaml").write_text(yaml.safe_dump({"pipelines": {"demo": demo}}))
    before = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        ran = CliRunner().invoke(app, ["run", "demo", "--root", str(tmp_path)])  # under its lock, then fails
        assert ran.exit_code == 2 and "context of 64 tokens" in " ".join(ran.output.split()), ran.output
        assert before.poll() is None, "the caller's own child process was ended by the command"
    finally:
        before.kill()
        before.wait()
