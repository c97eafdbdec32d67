"""`flywheel check --solve`: an environment's dry run (its solver and the null policy through the real harness and
rubric) on the shop example, the support desk and a key-value store whose rubric is made wrong on purpose; and the
split a task file's rows choose."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flywheel.agent import Harness, Limits
from flywheel.cli import app
from flywheel.config import PipelineConfig
from flywheel.data.tasksets import own_tasks
from flywheel.dryrun import dry_run, render
from flywheel.envs import get_environment

REPO = Path(__file__).resolve().parent.parent

KV = '''
import json, math, re
from pathlib import Path
from flywheel.envs.sdk import Env, Reward, ToolError, tasks_from_file

def make_env(rubric: str = "right", tool: str = "sound") -> Env:
    def put(key: str, value: str, state: dict) -> str:
        """Store a value under a key.

        Args:
            key: the key
            value: the value
        """
        if tool == "broken" and key == "k3":
            raise RuntimeError("disk full")
        state[key] = value
        return "ok"

    def stored(task, messages, state):
        return float(all(state.get(k) == v for k, v in task.data["store"].items()))

    def said(task, messages, state):
        return float(task.data["say"] in (messages[-1].get("content") or ""))

    def polite(task, messages, state):  # pays for silence: nothing said, nothing rude
        return 0.0 if "sorry" in (messages[-1].get("content") or "") else 1.0

    def poisoned(task, messages, state):
        return math.nan if task.data.get("poison") else 1.0

    def solve(messages, state):
        key, value = re.search(r"Store (\\w+) under (\\w+)", messages[1]["content"]).group(2, 1)
        if messages[-1]["role"] == "user":
            call = {"id": "c", "type": "function", "function": {"name": "put", "arguments": json.dumps(
                {"key": key, "value": value})}}
            return {"role": "assistant", "content": "", "tool_calls": [call]}
        return {"role": "assistant", "content": f"stored {key}"}

    rewards = {"right": [Reward(stored, 0.7), Reward(said, 0.3)],
               "pays_silence": [Reward(stored, 0.3), Reward(polite, 0.7)],
               "nan": [Reward(stored, 0.7), Reward(poisoned, 0.3)]}[rubric]
    return Env(name="kv", tools=[put], tasks=tasks_from_file(Path(__file__).parent / "tasks.jsonl"),
               rewards=rewards, setup=lambda task: {}, solver=solve)
'''


def _rows() -> list[dict]:
    """12 tasks: rows 1-3 held out by choice, row 5 poisoned (NaN under the `nan` rubric), row 12 asks the
    solver to say what it never says."""
    rows = []
    for i in range(12):
        row = {"prompt": [{"role": "system", "content": "You keep a key-value store."},
                          {"role": "user", "content": f"Store v{i} under k{i}, then say so."}],
               "answer": {"store": {f"k{i}": f"v{i}"}, "say": f"stored k{i}" if i < 11 else "done and dusted"}}
        if i < 3:
            row["split"] = "heldout"
        if i == 4:
            row["answer"]["poison"] = True
        rows.append(row)
    return rows


def _small() -> dict:
    """The test suite's small pipeline (tests/conftest.py) as a dict."""
    return yaml.safe_load((REPO / "tests" / "conftest.py").read_text().split('SMALL_PIPELINE = """')[1]
                          .split('"""')[0])["pipelines"]["small"]


def _project(root: Path, args: dict, rows: list[dict] | None = None, train: int = 20, heldout: int = 6) -> str:
    """A project with the key-value environment in a package of its own name; the pipeline's name."""
    package = f"kv_{uuid.uuid4().hex[:8]}"  # its own module: another test's copy stays in sys.modules
    (root / package).mkdir(parents=True)
    (root / package / "__init__.py").write_text(KV)
    (root / package / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows or _rows()))
    small = _small()
    small["environment"] = {"factory": f"{package}:make_env", "args": args, "train_tasks": train,
                            "heldout_tasks": heldout}
    (root / "pipelines.yaml").write_text(yaml.safe_dump({"pipelines": {"small": small}}))
    return "small"


def _check(root: Path, *args: str):
    return CliRunner().invoke(app, ["check", *args, "--root", str(root)])


def test_a_sound_environment_passes_with_the_solver_rate_and_its_one_failure_named(tmp_path):
    _project(tmp_path, {})
    result = _check(tmp_path, "small", "--solve")
    out = result.output
    assert result.exit_code == 0, out
    # rows 1-3 chose heldout, one more is held out by its hash
    assert "12 of its own tasks (8 train, 4 heldout; the config asks 20 and 6)" in out
    assert "solver: passes 11 of 12 tasks (92%)" in out
    assert "failed: kv_" in out and "/tasks.jsonl: row 12 (\"Store v11 under k11, then say so.\")" in out
    assert "reward 0.70; said 0.00" in out  # why: the part it missed
    assert "null policy (an empty answer, no calls): mean reward 0.000, passes 0 of 12" in out
    assert "tool calls: 12 (0 refused, 0 malformed or unknown, 0 broke, 0 timed out)" in out
    parts = next(line for line in out.splitlines() if line.strip().startswith("stored"))
    assert parts.split() == ["stored", "1.000", "0%", "100%", "0.000", "100%", "0%"]
    # the split against the config: 8 train tasks where 20 are asked, and why
    assert "gives 8 train tasks, fewer than environment.train_tasks 20" in out
    assert "the solver fails 1 of 12 tasks" in out and "error" not in out


def test_plain_check_warns_of_a_short_split_before_anything_runs(tmp_path):
    _project(tmp_path, {})
    result = _check(tmp_path)
    assert result.exit_code == 0, result.output
    assert "gives 8 train tasks, fewer than environment.train_tasks 20" in result.output
    assert "gives 4 heldout tasks, fewer than environment.heldout_tasks 6" in result.output


def test_a_rubric_that_pays_for_silence_is_warned_of_with_examples(tmp_path):
    _project(tmp_path, {"rubric": "pays_silence"})
    result = _check(tmp_path, "small", "--solve")
    assert result.exit_code == 0, result.output  # a warning, not an error
    assert "null policy (an empty answer, no calls): mean reward 0.700" in result.output
    warning = next(line for line in result.output.splitlines() if "rewards doing nothing" in line)
    assert "on 12 of 12 tasks" in warning and "over 0.2" in warning and "polite 1.00" in warning
    assert "tasks.jsonl: row " in warning  # examples name their rows


def test_a_nan_reward_is_an_error_naming_the_file_row_and_the_exit_is_nonzero(tmp_path):
    _project(tmp_path, {"rubric": "nan"})
    result = _check(tmp_path, "small", "--solve")
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("  error:")]
    assert len(errors) == 2, result.output  # the solver's episode and the null policy's, on the one poisoned row
    assert "reward 'poisoned' returned nan for " in errors[0]
    assert "tasks.jsonl: row 5 (\"Store v4 under k4, then say so.\")" in errors[0]
    assert "must be a number in [0, 1]: fix " in errors[0] and "poisoned (" in errors[0]  # where it is defined
    assert "solver: passes 11 of 11 tasks" in result.output  # the other tasks still ran


def test_a_tool_that_breaks_is_an_error(tmp_path):
    _project(tmp_path, {"tool": "broken"})
    result = _check(tmp_path, "small", "--solve")
    assert result.exit_code == 1, result.output
    assert "1 broke" in result.output
    error = next(line for line in result.output.splitlines() if "tool call(s) broke" in line)
    assert "tasks.jsonl: row 4" in error and "RuntimeError: disk full" in error


def test_a_sample_runs_that_many_tasks(tmp_path):
    _project(tmp_path, {})
    result = _check(tmp_path, "small", "--solve", "--sample", "4")
    assert result.exit_code == 0, result.output
    assert "12 of its own tasks (8 train, 4 heldout; the config asks 20 and 6); 4 sampled" in result.output
    assert "passes 0 of 4" in result.output


def test_a_bad_split_value_is_refused_naming_its_row(tmp_path):
    rows = _rows()
    rows[6]["split"] = "test"
    _project(tmp_path, {}, rows=rows)
    result = _check(tmp_path)
    assert result.exit_code == 1
    assert "row 7" in result.output and "split 'test' is neither 'train' nor 'heldout'" in result.output


def test_rows_choose_their_split_and_the_rest_split_by_hash(tmp_path):
    from flywheel.contract import split_of

    rows = _rows()
    rows[5]["split"] = "train"
    _project(tmp_path, {}, rows=rows, train=100, heldout=100)
    cfg = PipelineConfig.model_validate(yaml.safe_load((tmp_path / "pipelines.yaml").read_text())["pipelines"]
                                        ["small"])
    env = get_environment(factory=cfg.environment.factory, args=cfg.environment.args, root=tmp_path)
    tasks = {t.prompt[1]["content"].split()[1]: t for t in own_tasks(env, cfg.environment, 0.9)}
    assert {tasks[f"v{i}"].split for i in range(3)} == {"heldout"} and tasks["v5"].split == "train"
    hashed = [t for v, t in tasks.items() if v not in ("v0", "v1", "v2", "v5")]
    assert all(t.split == split_of(t.task_id, 0.9) for t in hashed)
    assert {t.split for t in hashed} == {"train", "heldout"}  # held out at 0.9: both splits are drawn


def test_shop_example_solver_solves_every_task_and_silence_earns_nothing(tmp_path):
    import shutil
    import subprocess
    import sys

    # a subprocess: examples.envs.shop imported here from a copy would stay in sys.modules for the next test
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    small = _small()
    small["environment"] = {"factory": "examples.envs.shop:make_env", "train_tasks": 60, "heldout_tasks": 10}
    (tmp_path / "pipelines.yaml").write_text(yaml.safe_dump({"pipelines": {"small": small}}))
    done = subprocess.run([str(Path(sys.executable).parent / "flywheel"), "check", "small", "--solve"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "solver: passes 70 of 70 tasks (100%)" in done.stdout
    assert "null policy (an empty answer, no calls): mean reward 0.000" in done.stdout
    assert "warning" not in done.stdout


def test_support_desk_dry_run():
    config = _small()
    config["environment"] = {"name": "support", "train_tasks": 40, "heldout_tasks": 10, "max_turns": 8}
    cfg = PipelineConfig.model_validate(config)
    report = dry_run("support", cfg, Harness(get_environment("support"), Limits.from_config(cfg.environment)))
    lines = render(report)
    assert report.solver.passed == len(report.solver.episodes) == report.checked
    assert report.null.mean_reward == 0.0 and not report.errors
    assert any(line.split()[:2] == ["resolved", "1.000"] for line in lines)
    # the parts logged beside the reward: an untouched database matches on tasks that change nothing
    db = next(line for line in lines if line.strip().startswith("db_matches")).split()
    assert 0.0 < float(db[4]) < 1.0


@pytest.mark.parametrize("sample", [None, 5])
def test_a_pipeline_with_no_tasks_yet_is_named_with_the_fix(tmp_path, sample):
    small = _small()
    small["environment"], small["teacher"] = {"name": "replay"}, {"policy": "none"}
    small["synthesize"]["include_accepted_traces"] = True
    (tmp_path / "pipelines.yaml").write_text(yaml.safe_dump({"pipelines": {"small": small}}))
    (tmp_path / "examples").mkdir()
    shutil.copytree(REPO / "examples" / "traces", tmp_path / "examples" / "traces")  # the traces, not collected yet
    args = ["small", "--solve"] + ([] if sample is None else ["--sample", str(sample)])
    result = _check(tmp_path, *args)
    assert result.exit_code == 1, result.output
    assert "run `flywheel stage collect -p small` first" in result.output
