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

from flywheel.cli.errors import error_block
from flywheel.errors import UserFacingError

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


# Exceptions that never reach the terminal as a command's error: each is caught where it is raised and becomes
# something else. Every other exception class of the project is one a user can fix (UserFacingError).
INTERNAL = {
    "flywheel.contract.ToolError": "a tool's failure, given to the model as the tool's result",
    "flywheel.data.shapes.BadRecord": "a malformed trace, quarantined with its reason and counted",
    "flywheel.data.shapes.PartialTurn": "a proxy call that ended in tool calls: its turn is in the next call",
    "flywheel.envs.replay.record.UnusableRecord": "a trace replay cannot serve, left out and counted",
    "flywheel.serving.traffic.UnknownAnswer": "an operator's verdict on an unknown answer: an HTTP 404",
    "flywheel.serving.chat.RequestError": "a client's bad request: an HTTP 400",
    "flywheel.train.rl.teacher.TeacherUnavailable": "the OPD server failed mid-run: the step's groups are dropped",
    "flywheel.train.sft_trainer.FinishedRun": "an SFT run resumed at max_steps: its checkpoint's weights are saved",
    "flows.processes.Stopped": "SIGTERM or SIGINT: `flywheel run` reports its runs, stops its processes, one line",
}


def _exception_classes() -> dict[str, type]:
    """Every exception class defined in flywheel/, tasks/ and flows/, by module and name."""
    import ast

    found = {}
    repo = Path(__file__).resolve().parent.parent
    for path in sorted(p for package in ("flywheel", "tasks", "flows") for p in (repo / package).rglob("*.py")):
        parts = list(path.relative_to(repo).with_suffix("").parts)
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and node.bases:
                cls = getattr(importlib.import_module(module), node.name)
                if isinstance(cls, type) and issubclass(cls, BaseException):
                    found[f"{module}.{node.name}"] = cls
    return found


def test_every_exception_is_a_user_facing_error_or_caught_inside():
    classes = _exception_classes()
    assert {"flywheel.config.sections.ConfigError", "flows.runlock.PipelineBusy", "tasks.rl.NoUpdatesError"} <= \
        set(classes)
    assert set(INTERNAL) <= set(classes), "an INTERNAL name no longer exists"
    neither = sorted(name for name, cls in classes.items()
                     if name not in INTERNAL and name != "flywheel.errors.UserFacingError"
                     and not issubclass(cls, UserFacingError))
    assert not neither, (f"exceptions neither UserFacingError nor caught inside (INTERNAL): {neither}; a user's "
                         "error subclasses flywheel.errors.UserFacingError, so the terminal shows its message alone")
    assert not [name for name in INTERNAL if issubclass(classes[name], UserFacingError)]


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


def _traceless(project: Path, teacher: str) -> None:
    """The small pipeline on a trace source whose files are gone; with teacher none, traces are its only targets."""
    config = yaml.safe_load((project / "pipelines.yaml").read_text())
    small = config["pipelines"]["small"]
    small["collect"]["sources"] = [{"name": "logs", "path": ["logs/agent/*.jsonl"]}]
    small["teacher"] = {"policy": teacher}
    small["synthesize"]["include_accepted_traces"] = teacher == "none"
    (project / "pipelines.yaml").write_text(yaml.safe_dump({"pipelines": {"small": small}}))


def test_a_missing_source_is_a_user_error_in_check_run_and_the_collect_stage(project):
    """A pipeline that cannot start without traces (teacher.policy none) whose source matches no file: one
    `error:` line naming the key, before any work, from `flywheel check`, `flywheel run` and `flywheel stage
    collect`, never "a bug". A pipeline that can start without them is warned and collects nothing from it."""
    from typer.testing import CliRunner

    from flywheel.cli import app
    from tasks.spec import dvc_yaml

    _traceless(project, "none")
    (project / "dvc.yaml").write_text(dvc_yaml(project))
    said = (f"{project / 'pipelines.yaml'}: pipelines.small.collect.sources.0.path: no file matches "
            f"'logs/agent/*.jsonl' under {project} (source 'logs'), and this pipeline cannot start without traces: "
            "its SFT targets come from traces (teacher.policy none); put the trace files there")
    checked = CliRunner().invoke(app, ["check", "--root", str(project)])
    assert checked.exit_code == 1
    assert [line for line in checked.output.splitlines() if line.startswith("error: ")][0].startswith(
        f"error: {said}"), checked.output
    config = yaml.safe_load((project / "pipelines.yaml").read_text())
    config["pipelines"]["broken"] = {"sft": {"learning_rate": 0.1}}  # another pipeline's errors do not stop this run
    (project / "pipelines.yaml").write_text(yaml.safe_dump(config))
    ran = CliRunner().invoke(app, ["run", "small", "--root", str(project)])
    assert ran.exit_code == 2 and ran.output.startswith(f"error: {said}"), ran.output
    assert "broken" not in ran.output
    assert not (project / "data").exists(), "no stage ran"
    collected = CliRunner().invoke(app, ["stage", "collect", "-p", "small", "--root", str(project)])
    assert collected.exit_code == 1
    errors = [line for line in collected.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: collect: {said}"), collected.output
    assert "bug" not in collected.output

    _traceless(project, "oracle")  # the calculator's tasks and the oracle's answers need no trace
    (project / "dvc.yaml").write_text(dvc_yaml(project))
    checked = CliRunner().invoke(app, ["check", "--root", str(project)])
    assert checked.exit_code == 0, checked.output
    assert ("  warning: pipelines.small.collect.sources.0.path: 'logs/agent/*.jsonl' matches no file under "
            f"{project} yet") in checked.output
    collected = CliRunner().invoke(app, ["stage", "collect", "-p", "small", "--root", str(project)])
    assert collected.exit_code == 0, collected.output
