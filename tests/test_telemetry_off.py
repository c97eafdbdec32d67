"""Analytics off for the commands the README and docs/ show, run from the project root without `make` or `flywheel`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def test_prefect_commands_in_the_project_root_send_no_analytics(tmp_path):
    """prefect.toml in the root: `prefect server start` there sends none (and logs no failure to send)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k != "DO_NOT_TRACK"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    shown = subprocess.run([str(BIN / "prefect"), "config", "view", "--show-sources"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "PREFECT_SERVER_ANALYTICS_ENABLED='False' (from prefect.toml)" in shown.stdout
    elsewhere = subprocess.run([str(BIN / "prefect"), "config", "view", "--show-defaults"], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=120)
    assert "PREFECT_SERVER_ANALYTICS_ENABLED='True'" in elsewhere.stdout  # the file is what switched it off


def test_the_readme_mlflow_commands_carry_the_telemetry_switch():
    """MLflow reads its switch from the environment alone: every `mlflow` command the README or a docs/ page shows
    sets it."""
    text = "\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    text = re.sub(r"\\\n\s*", " ", text)  # a command's continued lines joined
    lines = [line for line in text.splitlines()
             if re.search(r"mlflow (ui|server|models serve) ", line) and not re.search(r"`[^`]*mlflow", line)]
    assert len(lines) >= 2, "the README and docs/ show mlflow commands"
    assert all("MLFLOW_DISABLE_TELEMETRY=true" in line for line in lines), lines
