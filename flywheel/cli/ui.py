"""`flywheel ui`: the MLflow and Prefect UIs on the project's state, on chosen ports, wired to each other's API.

Prefect's UI asks its server's /ui-settings where the API is; `prefect server start --port P` alone leaves that at
PREFECT_API_URL or port 4200, so a UI on another port shows another server's runs or "Can't connect to Server
API". Each server here is told its own URL (PREFECT_UI_API_URL), and the run summary prints the same commands.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import typer

from flywheel.cli.app import ROOT, app, fail
from flywheel.cli.preflight import checked_root

BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class UiServer:
    """One UI server: what it is, where a browser opens it, how it starts (its own variables, then argv)."""

    name: str
    url: str
    env: dict[str, str]
    argv: list[str]
    health: str  # answers 200 once the server is up

    def command(self) -> str:
        """The server's start as one shell line."""
        return shlex.join([f"{k}={v}" for k, v in self.env.items()] + self.argv)


def ui_servers(root: Path, mlflow_port: int = 5000, prefect_port: int = 4200) -> list[UiServer]:
    """The MLflow UI on the project's tracking store and the Prefect UI on its Prefect home, on these ports."""
    home = os.environ.get("PREFECT_HOME") or str(root / ".flywheel" / "prefect")
    mlflow_url, prefect_url = f"http://127.0.0.1:{mlflow_port}", f"http://127.0.0.1:{prefect_port}"
    # MLflow reads its telemetry switch from the environment alone; Prefect also from prefect.toml in the root.
    # One reader on one SQLite file needs one worker, and none of MLflow's job runners (for its GenAI jobs): its
    # defaults (4 workers, 6 job consumers) took 23 CPU-seconds to start here, these 5.
    return [UiServer("MLflow UI", mlflow_url, {"MLFLOW_DISABLE_TELEMETRY": "true",
                                               "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                     [str(BIN / "mlflow"), "ui", "--backend-store-uri", os.environ["MLFLOW_TRACKING_URI"],
                      "--host", "127.0.0.1", "--port", str(mlflow_port), "--workers", "1"], f"{mlflow_url}/health"),
            UiServer("Prefect UI", prefect_url, {"PREFECT_HOME": home, "PREFECT_UI_API_URL": f"{prefect_url}/api"},
                     [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)],
                     f"{prefect_url}/api/health")]


def ui_commands(root: Path, mlflow_port: int = 5000, prefect_port: int = 4200) -> dict[str, str]:
    """The commands that start the two UIs, as the run summary prints them: name -> one shell line."""
    return {s.name: s.command() for s in ui_servers(root, mlflow_port, prefect_port)}


@app.command(rich_help_panel="Check and look")
def ui(root: Path = ROOT, mlflow_port: int = typer.Option(5000, "--mlflow-port"),
       prefect_port: int = typer.Option(4200, "--prefect-port"),
       timeout_s: float = typer.Option(180, "--timeout-s", help="How long each server may take to start.")) -> None:
    """Start the MLflow and Prefect UIs on this project's runs (Ctrl-C stops both)."""
    import signal
    import threading

    from flows.deployments import serving, stop_process_group

    root = checked_root(root)
    if os.environ.get("PREFECT_API_URL"):  # `flywheel run` records its flow runs there, not in the Prefect home
        typer.echo(f"note: PREFECT_API_URL is set: runs made with it are on that server, whose own UI is "
                   f"{os.environ['PREFECT_API_URL'].removesuffix('/').removesuffix('/api')}; the Prefect UI "
                   "started here shows the runs made without it")
    logs = root / ".flywheel" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # the UI's server is its own API
    started = []
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        for server in ui_servers(root, mlflow_port, prefect_port):
            log = logs / f"ui-{server.name.split()[0].lower()}.log"
            with log.open("ab") as out:
                process = subprocess.Popen(server.argv, env=env | server.env, cwd=root, stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True)
            started.append(process)
            if not serving(server.health, process, timeout_s):
                fail(f"{server.name} did not start on {server.url} (port taken? pass another with --"
                     f"{server.name.split()[0].lower()}-port); its log: {log}")
            typer.echo(f"{server.name}: {server.url}")
        typer.echo("Ctrl-C stops both")
        while not stop.wait(1.0):
            if any(p.poll() is not None for p in started):
                fail("a UI server exited; its log is under " + str(logs))
    except KeyboardInterrupt:
        pass
    finally:
        for process in started:
            stop_process_group(process)
