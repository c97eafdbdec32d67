"""The project's settings (flywheel/settings.py): what a fresh project root prints."""

from __future__ import annotations

import os
import subprocess
import sys


def test_a_fresh_root_creates_mlflows_tables_without_its_info_lines(tmp_path):
    """MLflow's store under .flywheel/ is made on first use; its table-creation INFO lines are not printed."""
    script = ("from pathlib import Path\nfrom flywheel.settings import configure\nconfigure(Path('.'))\n"
              "import mlflow\nprint(mlflow.MlflowClient().search_experiments()[0].name)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "Default" and (tmp_path / ".flywheel" / "mlflow.db").is_file()
    assert "database tables" not in done.stderr, done.stderr
