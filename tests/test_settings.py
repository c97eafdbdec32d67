"""The project's settings (flywheel/settings.py): what a fresh project root prints."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time

from conftest import REPO


def test_a_fresh_root_creates_mlflows_tables_without_its_info_lines(tmp_path):
    """MLflow's store under .flywheel/ is made on first use; its table-creation INFO lines are not printed."""
    script = ("from pathlib import Path\nfrom flywheel.settings import configure\nconfigure(Path('.'))\n"
              "import mlflow\nprint(mlflow.MlflowClient().search_experiments()[0].name)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "Default" and (tmp_path / ".flywheel" / "mlflow.db").is_file()
    assert "database tables" not in done.stderr, done.stderr
    with sqlite3.connect(tmp_path / ".flywheel" / "mlflow.db") as db:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",), "readers never block a writer"


def test_the_project_store_lets_a_write_commit_beside_a_read_that_never_finished(tmp_path):
    """A stage stopped in the middle of an MLflow read leaves its statement open; the write that marks its run
    KILLED still commits at once (SQLite's default mode made it wait 20 s and fail "database is locked")."""
    from mlflow import MlflowClient

    from flywheel.settings import write_ahead

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    write_ahead(uri)
    c = MlflowClient(tracking_uri=uri)
    experiment = c.create_experiment("stopped")
    runs = [c.create_run(experiment).info.run_id for _ in range(2)]
    reader = sqlite3.connect(tmp_path / "mlflow.db")
    pending = reader.execute("SELECT run_uuid FROM runs")
    assert pending.fetchone() is not None  # one row of two read: the statement holds its read open
    started = time.monotonic()
    c.set_terminated(runs[0], "KILLED")
    assert time.monotonic() - started < 5 and c.get_run(runs[0]).info.status == "KILLED"
    reader.close()


# A project's first server start, as `flywheel run` makes it (a process whose Prefect settings read PREFECT_HOME),
# with one flow run, and what the server then answers
_START = """
import json
from prefect import flow, get_client
from flows.processes import start_prefect_server
server = start_prefect_server(lambda **_: None)
try:
    with get_client(sync_client=True) as client:
        before = len(client.read_flow_runs()), len(client.read_block_types())
    flow(lambda: 1, name="hello")()
finally:
    server.stop()
print(json.dumps(before))
"""


def test_a_new_projects_prefect_database_is_copied_from_the_first_ones_migrated_template(tmp_path, monkeypatch):
    """The first server start on a new project migrates its database and keeps it as the template (no run in
    it); a second new project's database is that copy before its server starts, and the server starts on it; a
    database named elsewhere (or a named server) is left alone."""
    from flywheel.settings import PREFECT_TEMPLATE_ENV, embedded_prefect_database, seed_prefect_database

    template = tmp_path / "template"
    monkeypatch.setenv(PREFECT_TEMPLATE_ENV, str(template))
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {PREFECT_TEMPLATE_ENV: str(template)}

    def started_in(home):
        done = subprocess.run([sys.executable, "-c", _START], env=env | {"PREFECT_HOME": str(home)}, cwd=REPO,
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.splitlines()[-1])

    def tables(database):
        with sqlite3.connect(database) as db:
            version = db.execute("SELECT version_num FROM alembic_version").fetchall()
            return version, db.execute("SELECT count(*) FROM flow_run").fetchone()[0]

    runs, block_types = started_in(tmp_path / "first")
    assert runs == 0 and block_types > 0
    kept = tables(template / "prefect.db")
    assert kept[0] and kept[1] == 0, "the template holds no run"
    assert tables(tmp_path / "first" / "prefect.db")[1] == 1

    second = tmp_path / "second" / "prefect.db"
    assert not seed_prefect_database(embedded_prefect_database({"PREFECT_HOME": str(second.parent)}))
    assert tables(second) == kept and (second.parent / "memo_store.toml").is_file()
    assert started_in(second.parent) == [0, block_types]
    assert tables(second)[1] == 1

    for named in ({"PREFECT_API_URL": "http://127.0.0.1:1/api"},
                  {"PREFECT_API_DATABASE_CONNECTION_URL": "postgresql+asyncpg://p@h/p"}):
        assert embedded_prefect_database({"PREFECT_HOME": str(tmp_path / "third")} | named) is None
