"""flows/concurrency.py: one run of a pipeline at a time across project folders and machines, through a global
concurrency limit on a real Prefect server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import REPO, SMALL_PIPELINE, make_project

from flows.concurrency import check, limit_name, pipeline_slot
from flows.runlock import PipelineBusy
from flywheel.tags import SLOT_LEASE_TAG_PREFIX, SLOT_TAG_PREFIX

BIN = Path(sys.executable).parent


def _flow_run(client, name: str):
    """A flow run of a throwaway flow, RUNNING as a retrain flow run is while it holds the slot."""
    from prefect import flow
    from prefect.states import Running

    @flow(name="slot-holder")
    def holder():
        pass

    run = client.create_flow_run(holder, name=name, parameters={})
    client.set_flow_run_state(run.id, Running(), force=True)
    return client.read_flow_run(run.id)


def _holder_process(pipeline: str, flow_run_id: str, hold_s: float, done: Path | None = None) -> subprocess.Popen:
    """Another process (a worker elsewhere) that holds the slot for hold_s seconds; prints "held" once it does, and
    writes `done` as the last thing before letting go."""
    from prefect.settings import PREFECT_API_URL

    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from flows.concurrency import pipeline_slot
        with pipeline_slot({pipeline!r}, {flow_run_id!r}):
            print("held", flush=True)
            time.sleep({hold_s})
            if {str(done) if done else ""!r}:
                Path({str(done)!r}).write_text("done")
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_API_URL": PREFECT_API_URL.value()}
    process = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert process.stdout.readline().strip() == "held", process.stderr.read()[-3000:]
    return process


def _limit(client, pipeline: str):
    return client.read_global_concurrency_limit_by_name(limit_name(pipeline))


def test_a_second_holder_is_refused_naming_the_first_and_the_slot_is_freed_after(prefect_server):
    from prefect import get_client

    with get_client(sync_client=True) as client:
        first, second = _flow_run(client, "first"), _flow_run(client, "second")
        with pipeline_slot("slot-a", str(first.id)):
            assert _limit(client, "slot-a").active_slots == 1
            assert f"{SLOT_TAG_PREFIX}slot-a" in client.read_flow_run(first.id).tags
            with pytest.raises(PipelineBusy) as refused:
                with pipeline_slot("slot-a", str(second.id)):
                    pytest.fail("two holders of one slot")
            assert f"Prefect flow run {first.id} ('first', RUNNING since" in str(refused.value)
            assert "run with --wait" in str(refused.value) and limit_name("slot-a") in str(refused.value)
            with pipeline_slot("slot-b", str(second.id)):  # another pipeline's slot is free
                pass
            assert [line for line in check("slot-a") if f"held by Prefect flow run {first.id}" in line]
        assert _limit(client, "slot-a").active_slots == 0
        assert not [t for t in client.read_flow_run(first.id).tags if t.startswith(SLOT_TAG_PREFIX)]
        with pipeline_slot("slot-a", str(second.id)):
            pass


def test_wait_starts_when_the_holder_in_another_process_ends(prefect_server, capsys, tmp_path):
    from prefect import get_client

    with get_client(sync_client=True) as client:
        first, second = _flow_run(client, "first"), _flow_run(client, "second")
    holder = _holder_process("slot-wait", str(first.id), hold_s=4, done=tmp_path / "done")
    try:
        with pipeline_slot("slot-wait", str(second.id), wait=True):
            assert (tmp_path / "done").exists(), "entered while the other process held the slot"
    finally:
        holder.kill()
        holder.wait()
    assert f"waiting for the running 'slot-wait' run to finish (Prefect flow run {first.id}" in capsys.readouterr().out


def test_the_slot_of_a_killed_holder_is_released_once_its_flow_run_is_crashed(prefect_server, caplog):
    """SIGKILL: the holder cannot let go. Its lease would lapse in LEASE_S; once its flow run says CRASHED (the
    stack's heartbeat automation, or `flywheel status` finding its file lock) the next run takes the slot at
    once, and `flywheel status` does the same."""
    from prefect import get_client
    from prefect.states import Crashed

    with get_client(sync_client=True) as client:
        victims = [_flow_run(client, f"victim-{i}") for i in range(2)]
        after = _flow_run(client, "after")
        for victim, release in zip(victims, ("next run", "status"), strict=True):
            holder = _holder_process("slot-killed", str(victim.id), hold_s=600)
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()
            with pytest.raises(PipelineBusy, match=f"Prefect flow run {victim.id}"):
                with pipeline_slot("slot-killed", str(after.id)):
                    pass
            client.set_flow_run_state(victim.id, Crashed(message="killed"), force=True)
            if release == "status":
                [line] = check("slot-killed")
                assert f"released slot {limit_name('slot-killed')} of flow run {victim.id}" in line
                assert _limit(client, "slot-killed").active_slots == 0
            with pipeline_slot("slot-killed", str(after.id)):
                assert _limit(client, "slot-killed").active_slots == 1
            assert not [t for t in client.read_flow_run(victim.id).tags if t.startswith(SLOT_LEASE_TAG_PREFIX)]
    assert any(f"of flow run {victims[0].id}" in r.message and "ended without letting go" in r.message
               for r in caplog.records)


def test_a_slot_taken_with_no_holder_recorded_is_reset(prefect_server, monkeypatch):
    """A slot counted as taken that no flow run claims (a server on in-memory leases lost them in a restart); reset
    after UNCLAIMED_S (LEASE_S and more: any lease behind it has lapsed by then; 10 s here)."""
    from prefect import get_client

    monkeypatch.setattr("flows.concurrency.UNCLAIMED_S", 10.0)
    with get_client(sync_client=True) as client:
        run = _flow_run(client, "after-restart")
        with pipeline_slot("slot-lost", str(run.id)):
            pass
        client.increment_concurrency_slots([limit_name("slot-lost")], 1, "concurrency")  # no lease, no holder
        assert _limit(client, "slot-lost").active_slots == 1
        started = time.monotonic()
        with pipeline_slot("slot-lost", str(run.id)):
            assert _limit(client, "slot-lost").active_slots == 1
        assert time.monotonic() - started >= 10, "reset only after UNCLAIMED_S"
        assert _limit(client, "slot-lost").active_slots == 0


def test_without_a_server_the_slot_is_not_taken_and_an_unreachable_one_is_said():
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.deployments import free_port

    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert check("anything") == []
        with pipeline_slot("anything", ""):
            pass
    with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{free_port()}/api"}):
        [line] = check("anything")
    assert "anything: slot flywheel-retrain-anything not checked: no answer from http://127.0.0.1:" in line


@pytest.mark.slow
def test_two_project_folders_on_one_server_train_one_pipeline_at_a_time(tmp_path, prefect_api):
    """Two checkouts of the project (two workers' folders: no file lock in common) run `flywheel run small`
    against the same Prefect server: one trains, the other stops naming it."""
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    projects = [make_project(tmp_path / f"worker-{i}", tmp_path / f"remote-{i}") for i in range(2)]
    for project in projects:
        (project / "pipelines.yaml").write_text(SMALL_PIPELINE.replace("steps: 60,", "steps: 200,"))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}

    def start(project: Path) -> subprocess.Popen:
        env = base | {"PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONPATH": str(project), "COLUMNS": "200",
                      "PREFECT_API_URL": prefect_api, "PREFECT_HOME": str(project / ".prefect-home"),
                      "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
        return subprocess.Popen([str(BIN / "flywheel"), "run", "small", "--no-push"], cwd=project, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    runs = [start(project) for project in projects]
    try:
        said = [run.communicate(timeout=900)[0] for run in runs]
    finally:
        for run in runs:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
    codes = [run.returncode for run in runs]
    assert sorted(codes) == [0, 1], said
    trained, refused = (0, 1) if codes[0] == 0 else (1, 0)
    with temporary_settings({PREFECT_API_URL: prefect_api}), get_client(sync_client=True) as client:
        flow_runs = {str(r.parameters["root"]): r for r in client.read_flow_runs()}
        holder = flow_runs[str(projects[trained])]
        assert holder.state.is_completed()
        assert flow_runs[str(projects[refused])].state.is_failed()
        assert _limit(client, "small").active_slots == 0
    assert (f"error: pipeline 'small' is already running elsewhere: Prefect flow run {holder.id}"
            in said[refused]), said[refused]
    assert f"project {projects[trained]} on " in said[refused]
    assert (projects[trained] / "models/small").exists() and not (projects[refused] / "models/small").exists()
