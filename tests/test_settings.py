"""The project's settings (flywheel/settings.py): what a fresh project root prints."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time


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
