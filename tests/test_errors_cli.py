"""A command that fails on bad input says so in one short block: `error: STAGE: MESSAGE` and where the full traceback
went (.flywheel/logs/); Prefect's copies of the traceback stay off the terminal. `flywheel --debug` shows them."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from conftest import make_project

from flywheel.cli import USER_ERRORS, error_block

BIN = Path(sys.executable).parent

# an environment whose only reward returns 1.5 for every episode: synthesize's oracle teacher meets it first
GENEROUS = '''
from flywheel.envs.sdk import Env, Task


def echo(text: str) -> str:
    """Echo the text."""
    return text


def too_generous(task, messages) -> float:
    return 1.5


def solve(messages):
    return {"role": "assistant", "content": "done"}


def make_env() -> Env:
    tasks = [Task(f"t{i}", "", [{"role": "user", "content": f"say {i}"}], "{}", "all") for i in range(40)]
    return Env(name="generous", tools=[echo], tasks=lambda seed: iter(tasks), rewards=[too_generous], solver=solve)
'''


def test_every_user_error_name_is_a_class_that_imports():
    for name in USER_ERRORS:
        module, _, cls = name.rpartition(".")
        assert isinstance(getattr(importlib.import_module(module), cls), type), name


def test_a_user_error_is_its_message_and_a_bug_says_it_is_one(tmp_path):
    from flywheel.config import ConfigError

    log = tmp_path / "x.log"
    assert error_block(ConfigError("pipelines.yaml: pipelines.small.sft.steps: must be > 0"), log) == [
        "error: pipelines.yaml: pipelines.small.sft.steps: must be > 0", f"full traceback: {log}"]
    bug = error_block(KeyError("x"), log)
    assert bug[0] == "error: KeyError: 'x'" and "bug" in bug[1] and bug[2] == f"full traceback: {log}"


@pytest.fixture
def generous(tmp_path, prefect_server) -> tuple[Path, dict]:
    """(project root, environment for its commands): the small pipeline on a factory environment whose reward
    returns 1.5."""
    from prefect.settings import PREFECT_API_URL

    from tasks.spec import dvc_yaml

    root = make_project(tmp_path / "project", tmp_path / "dvc-remote")
    module = f"generous_{uuid.uuid4().hex[:8]}"  # a name no other test's subprocess has imported
    (root / f"{module}.py").write_text(GENEROUS)
    config = yaml.safe_load((root / "pipelines.yaml").read_text())
    config["pipelines"]["small"]["environment"] = {"factory": f"{module}:make_env", "train_tasks": 30,
                                                   "heldout_tasks": 2, "max_turns": 2}
    (root / "pipelines.yaml").write_text(yaml.safe_dump(config))
    (root / "dvc.yaml").write_text(dvc_yaml(root))
    state = tmp_path / "state"
    env = {**os.environ, "PYTHONPATH": str(root), "PATH": f"{BIN}:{os.environ['PATH']}", "COLUMNS": "200",
           "MLFLOW_TRACKING_URI": f"sqlite:///{state / 'mlflow.db'}", "PREFECT_HOME": str(state / "prefect"),
           "PREFECT_API_URL": PREFECT_API_URL.value(),
           "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(state / "prefect-results")}
    env.pop("FLYWHEEL_DEBUG", None)
    return root, env


def _flywheel(root: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "flywheel"), *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_a_reward_out_of_range_stops_run_with_one_error_line_and_the_traceback_in_a_log(generous):
    root, env = generous
    done = _flywheel(root, env, "run", "small", "--no-push")
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert len(output.splitlines()) < 15, output
    assert "Traceback" not in output, output
    error = next(line for line in output.splitlines() if line.startswith("error: "))
    assert error.startswith("error: synthesize: ") and "'too_generous'" in error and "1.5" in error, error
    assert "[0, 1]" in error and re.search(r"\bt\d+\b|say \d+", error), error  # the task: its id or prompt
    log = Path(re.search(r"^full traceback: (.+)$", output, re.M).group(1))
    assert log.parent == root / ".flywheel" / "logs" and log.name.endswith("-run.log")
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "RubricError" in text
    assert "Task run failed with exception" in text  # Prefect's report went here, not to the terminal

    debug = _flywheel(root, env, "--debug", "run", "small", "--no-push")
    assert debug.returncode == 1
    assert "Traceback" in debug.stdout + debug.stderr and "RubricError" in debug.stdout + debug.stderr
