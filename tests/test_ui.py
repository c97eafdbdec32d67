"""`flywheel ui`: both UIs on ports other than their defaults, the Prefect UI wired to its own server's API.

Prefect's UI reads /ui-settings for the API it calls: a `prefect server start --port P` alone would answer
PREFECT_API_URL's server or port 4200 there, and show no runs. Here a shell that points PREFECT_API_URL at a dead
server starts the UIs on free ports; the settings name the UI's own server, and through it the runs are listed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from flows.deployments import free_port

REPO = Path(__file__).resolve().parent.parent
FLOW = "from prefect import flow\nflow(name='retrain')(lambda: 1)()\n"


@pytest.mark.slow
def test_the_prefect_ui_on_another_port_lists_the_runs_of_the_project(tmp_path, mlflow_store):
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(REPO / "pipelines.yaml", project / "pipelines.yaml")
    home = project / ".flywheel" / "prefect"
    home.mkdir(parents=True)
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "240"}
    env.pop("PREFECT_API_URL", None)
    # a run recorded as `flywheel run` records them: Prefect's temporary server on the project's Prefect home
    ran = subprocess.run([sys.executable, "-c", FLOW], env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stdout + ran.stderr

    prefect_port, mlflow_port = free_port(), free_port()
    env["PREFECT_API_URL"] = f"http://127.0.0.1:{free_port()}/api"  # another (here dead) server the shell names
    ui = subprocess.Popen([str(Path(sys.executable).parent / "flywheel"), "ui", "--root", str(project),
                           "--prefect-port", str(prefect_port), "--mlflow-port", str(mlflow_port)],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(ui.stdout), daemon=True).start()
    try:
        deadline = time.monotonic() + 300
        while not any(line.startswith("Ctrl-C") for line in lines):
            assert ui.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.5)
        assert f"Prefect UI: http://127.0.0.1:{prefect_port}\n" in lines
        assert f"MLflow UI: http://127.0.0.1:{mlflow_port}\n" in lines
        assert any(line.startswith("note: PREFECT_API_URL is set: runs made with it are on that server") for line
                   in lines), lines  # the shell's server is named, not silently shown or hidden

        settings = httpx.get(f"http://127.0.0.1:{prefect_port}/ui-settings", timeout=30).json()
        assert settings["api_url"] == f"http://127.0.0.1:{prefect_port}/api"
        runs = httpx.post(f"{settings['api_url']}/flow_runs/filter", json={}, timeout=30).json()
        assert [r["state_type"] for r in runs] == ["COMPLETED"]
        flows = httpx.post(f"{settings['api_url']}/flows/filter", json={}, timeout=30).json()
        assert [f["name"] for f in flows] == ["retrain"]
        assert httpx.get(f"http://127.0.0.1:{mlflow_port}/health", timeout=30).status_code == 200
    finally:
        ui.send_signal(signal.SIGTERM)
        ui.wait(timeout=60)
    for port in (prefect_port, mlflow_port):  # both servers stopped with the command
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/", timeout=5)
